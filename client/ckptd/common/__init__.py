"""Pure types shared by the client and the daemon: no torch, no grpc, no file system."""
