"""TEST-ONLY fault injection, armed by environment variables that only the test suite sets:
kills at the N-th file event under the root (files.py) or object-store request (objects.py)."""
