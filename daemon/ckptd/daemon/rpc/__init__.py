"""The wire edge: servicers (validate -> call the engine -> convert), conversion, error mapping, peer authentication and TLS, the peer client."""
