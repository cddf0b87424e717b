# Sourced by setup_vllm.sh and setup_matrix.sh: a venv cached by stamps, rebuilt from scratch when its base (the
# pinned third-party set) changes and re-linked to this checkout when the checkout path or pyproject.toml moves.
#
# The caller sets ROOT (the checkout), VENV, PY (the python that makes it), TORCH_VERSION and BASE_STAMP, then:
#   cached_venv_open NAME PREFIX "(versions)"   # lock; exit 0 saying "PREFIX: $VENV is up to date (versions)"
#                                               # when both stamps match
#   cached_venv_base [STEPS]                    # rebuild when the base stamp differs; STEPS: a function of its
#                                               # own installs, run after torch
#   ...re-link this package, check it imports...
#   cached_venv_done                            # "PREFIX: $VENV ready in N s (size)"
# NAME names the stamps ($VENV/.orpheus-NAME-base, -project) and the lock; PREFIX starts each message.

# The checkout the project stamp stands for: its path and its pyproject.toml.
cached_venv_proj_stamp() { echo "root=$ROOT pyproject=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"; }

cached_venv_open() {
    local name=$1
    CACHED_VENV_NAME=$name
    CACHED_VENV_PREFIX=$2
    VPY=$VENV/bin/python
    mkdir -p "$(dirname "$VENV")"
    if command -v flock >/dev/null; then
        exec 9>"${TMPDIR:-/tmp}/orpheus-$name-$(echo "$VENV" | sha256sum | cut -c1-16).lock"
        flock 9   # another checkout may be building or re-linking the same cached venv
    fi
    if [ -x "$VPY" ] && [ "$(cat "$VENV/.orpheus-$name-base" 2>/dev/null)" = "$BASE_STAMP" ] \
        && [ "$(cat "$VENV/.orpheus-$name-project" 2>/dev/null)" = "$(cached_venv_proj_stamp)" ]; then
        echo "$CACHED_VENV_PREFIX: $VENV is up to date $3"
        exit 0
    fi
    CACHED_VENV_START=$(date +%s)
}

# When the base stamp does not match: the venv made afresh with pip upgraded and torch in, then the caller's own
# base steps (the function named by $1, if any), then the base stamp. Called as a plain command, so that `set -e`
# holds inside (it does not in an `if` condition).
cached_venv_base() {
    if [ "$(cat "$VENV/.orpheus-$CACHED_VENV_NAME-base" 2>/dev/null)" = "$BASE_STAMP" ] && [ -x "$VPY" ]; then
        return 0
    fi
    # A partial or outdated venv is rebuilt from scratch: cheaper to reason about than repairing it.
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"   # keep git from listing the venv when it lies inside the work tree
    "$VPY" -m pip install -q --upgrade pip
    "$VPY" -m pip install -q "torch==$TORCH_VERSION"
    if [ -n "${1:-}" ]; then "$1"; fi
    echo "$BASE_STAMP" > "$VENV/.orpheus-$CACHED_VENV_NAME-base"
    rm -f "$VENV/.orpheus-$CACHED_VENV_NAME-project"
}

cached_venv_done() {
    cached_venv_proj_stamp > "$VENV/.orpheus-$CACHED_VENV_NAME-project"
    echo "$CACHED_VENV_PREFIX: $VENV ready in $(( $(date +%s) - CACHED_VENV_START )) s ($(du -sh "$VENV" | cut -f1))"
}
