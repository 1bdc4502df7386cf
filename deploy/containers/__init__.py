"""The project in containers: the engine and the images (`engine.sh`, driven from Python by
`engine.py`), containers of those images for tests (`stack.py`), and the sidecar deployment
(`compose.yaml`, `compose.py`; `k8s/` for Kubernetes). docs/deploying.md describes them."""
