"""The KV digest hook (pd_kv_digest.py in this folder), armed when the harness sets PD_HARNESS_KV_DIGEST.

Put first on PYTHONPATH: this runs the next sitecustomize.py on the path (the fault hook, the CPU tuning), then
installs its import hooks in front of theirs, so that its wrappers go outside theirs (a fault's change is seen).
"""

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGETS = {
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker": ("NixlBaseConnectorWorker", "patch_worker"),
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", "patch_runner"),
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, fullname):
        self._inner, self._name = inner, fullname

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        import pd_kv_digest as hook

        cls_name, patch = _TARGETS[self._name]
        cls = getattr(module, cls_name, None)
        if cls is None:
            hook._unavailable(0, f"{self._name} has no {cls_name}: this vLLM's internals are not known to the hook")
            return
        try:
            getattr(hook, patch)(cls)
        except Exception as e:  # noqa: BLE001 - a hook that cannot arm must not take the server down
            hook._unavailable(0, f"could not hook {cls_name} ({type(e).__name__}: {e})")


class _Finder(importlib.abc.MetaPathFinder):
    _busy = False  # another hook's finder asks the whole meta path too: answer only the outer call

    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS or self._busy:
            return None
        self._busy = True
        try:
            return self._find(fullname, path, target)
        finally:
            self._busy = False

    def _find(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def _chain():
    """Run the next sitecustomize.py on sys.path after this folder's (this module's name shadows it)."""
    entries = [os.path.abspath(e or ".") for e in sys.path]
    start = entries.index(_HERE) + 1 if _HERE in entries else 0
    for entry in entries[start:]:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry != _HERE and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_pd_harness_digest_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_chain()
if os.environ.get("PD_HARNESS_KV_DIGEST"):
    sys.meta_path.insert(0, _Finder())
