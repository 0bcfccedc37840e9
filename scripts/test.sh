#!/usr/bin/env bash
# test.sh — the workspace tests on a fresh machine, in one command: install what the tests need
# when it is missing, then run `cargo test --workspace --all-targets` (extra arguments are passed
# to cargo test). `.ci/run` calls it too.
#
# What the tests need beyond Rust:
#   - Debian packages (apt-get; root, or sudo when available): `nats-server` and `etcd-server`,
#     whose servers the real-server tests start on 127.0.0.1;
#   - PyPI tools (pip, into a private virtual environment under $KVRELAY_TOOLS, default
#     ~/.cache/kvrelay-tools, put first on PATH): listed in PYPI_TOOLS below as
#     `command=package`: kubernetes-validate (the Kubernetes manifests against the API schemas).
#
# A tool counts as present when its command is on PATH or in one of $KVRELAY_TOOL_DIRS
# (default "/usr/sbin /sbin": Debian installs nats-server there, outside a non-root PATH).
#
#   bash scripts/test.sh            install what is missing, then run the tests
#   bash scripts/test.sh --plan     print what would be installed and run; change nothing
#
# Only shell builtins run before the first install, so --plan works with any PATH.
set -euo pipefail

# command=Debian package
APT_TOOLS=("nats-server=nats-server" "etcd=etcd-server")
# command=PyPI package
PYPI_TOOLS=("kubernetes-validate=kubernetes-validate")

cd "${BASH_SOURCE[0]%/*}/.."

read -r -a TOOL_DIRS <<<"${KVRELAY_TOOL_DIRS-/usr/sbin /sbin}"
TOOLS_HOME="${KVRELAY_TOOLS:-${HOME:-/root}/.cache/kvrelay-tools}"

have() {
  command -v "$1" >/dev/null 2>&1 && return 0
  local dir
  for dir in "${TOOL_DIRS[@]}"; do
    [[ -x "$dir/$1" ]] && return 0
  done
  return 1
}

plan=0
if [[ "${1:-}" == "--plan" ]]; then
  plan=1
  shift
fi

missing_apt=()
for entry in "${APT_TOOLS[@]}"; do
  tool="${entry%%=*}" package="${entry#*=}"
  if have "$tool"; then
    echo "have $tool"
  else
    echo "install $tool (Debian package $package)"
    missing_apt+=("$package")
  fi
done
if [[ -d "$TOOLS_HOME/venv/bin" ]]; then
  PATH="$TOOLS_HOME/venv/bin:$PATH"
fi
missing_pypi=()
for entry in "${PYPI_TOOLS[@]}"; do
  tool="${entry%%=*}" package="${entry#*=}"
  if have "$tool"; then
    echo "have $tool"
  else
    echo "install $tool (PyPI package $package)"
    missing_pypi+=("$package")
  fi
done
echo "run cargo test --workspace --all-targets${*:+ $*}"
if ((plan)); then
  exit 0
fi

as_root() {
  if [[ "$(id -u)" == 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "test.sh: $* needs root (or sudo)" >&2
    exit 1
  fi
}

apt_updated=0
apt_install() {
  if ((!apt_updated)); then
    as_root apt-get update
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@"
}

if ((${#missing_apt[@]})); then
  apt_install "${missing_apt[@]}"
fi
if ((${#missing_pypi[@]})); then
  if ! python3 -m venv --help >/dev/null 2>&1; then
    apt_install python3-venv python3-pip
  fi
  [[ -x "$TOOLS_HOME/venv/bin/pip" ]] || python3 -m venv "$TOOLS_HOME/venv"
  # A PyPI tool only adds a check (the tests that need one say SKIPPED without it), so an
  # unreachable index warns instead of stopping the run.
  "$TOOLS_HOME/venv/bin/pip" install --quiet "${missing_pypi[@]}" ||
    echo "test.sh: warning: could not install ${missing_pypi[*]} from PyPI" >&2
  PATH="$TOOLS_HOME/venv/bin:$PATH"
fi
export PATH

cargo test --workspace --all-targets "$@"
