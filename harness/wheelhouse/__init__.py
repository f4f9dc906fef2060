"""The offline wheelhouse: one folder of wheels that installs vLLM, NIXL and the harness on an air-gapped node
(``python -m harness wheelhouse``, ``make setup WHEELHOUSE=DIR``; docs/offline-install.md)."""
