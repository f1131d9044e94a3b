"""How a rank hands a save over to the daemon (docs/architecture.md, the client's hand-off).

modes.py: the mode names. base.py: the HandoffTransport protocol, the DeviceBackend seam, the
pending snapshot and its fences. shm.py, cuda.py, ipc.py: one transport each. select.py: the
choice by mode name and a client's hand-off state (`Handoff`).
"""
