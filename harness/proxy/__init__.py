"""The P/D routing proxy (app and faults); toy_proxy_server.py is its command-line entry."""
