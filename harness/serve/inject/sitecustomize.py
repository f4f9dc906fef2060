"""What the harness injects into a vLLM server, with no change to vLLM: the KV digest (pd_kv_digest.py, when
PD_HARNESS_KV_DIGEST names a folder) and the decode-KV faults (pd_kv_fault.py, when a PD_HARNESS_FAULT_* variable is
set). The harness puts this folder first on PYTHONPATH; this module runs the next sitecustomize.py on the path (the
CPU tuning), then installs one import hook in front of it that patches vLLM's classes as they load: the fault first,
then the digest, so that the digest's wrapper is the outer one and sees what a fault changed.
"""

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_CLASSES = {_WORKER: "NixlBaseConnectorWorker", _RUNNER: "GPUModelRunner"}


def _patches(fullname):
    """(hook module, patch function) for ``fullname``, in the order they are applied."""
    import pd_kv_digest as digest
    import pd_kv_fault as fault

    out = []
    if fullname == _WORKER and fault.ARMED:
        out.append((fault, fault.patch_worker))
    if digest.FOLDER:
        out.append((digest, digest.patch_worker if fullname == _WORKER else digest.patch_runner))
    return out


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, fullname):
        self._inner, self._name = inner, fullname

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        cls = getattr(module, _CLASSES[self._name], None)
        for hook, patch in _patches(self._name):
            if cls is None:
                hook.unknown(f"{self._name} has no {_CLASSES[self._name]}: this vLLM's internals are not known")
                continue
            try:
                patch(cls)
            except Exception as e:  # noqa: BLE001 - a hook that cannot arm must not take the server down
                hook.unknown(f"could not hook {cls.__name__} ({type(e).__name__}: {e})")


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps whatever loader the rest of the import path gives these modules (the CPU tuning patches one too)."""

    _busy = False  # a finder behind this one may ask the whole meta path again: answer only the outer call

    def find_spec(self, fullname, path, target=None):
        if fullname not in _CLASSES or self._busy:
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
            spec = importlib.util.spec_from_file_location("_pd_harness_next_sitecustomize", candidate)
            if spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_chain()
if os.environ.get("PD_HARNESS_KV_DIGEST") or any(k.startswith("PD_HARNESS_FAULT_") for k in os.environ):
    sys.meta_path.insert(0, _Finder())  # after the chained tuning installed its hook, so this one wraps it
