# Sourced by scripts/test.sh and scripts/run.sh: create .venv if missing and install this project
# into it (editable: calc/data/cards.py reads model_cards/ beside the package) with the extras in $1
# (comma-separated; empty for the core only).
# The install is skipped when pyproject.toml is unchanged and every extra asked for was installed.

ensure_venv() {
    local extras="$1"
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local venv="$root/.venv"
    local python="${PYTHON:-python3}"

    if [[ ! -x "$venv/bin/python" ]]; then
        "$python" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' || {
            echo "vramplan needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
            return 1
        }
        echo "==> creating $venv" >&2
        "$python" -m venv "$venv"
    fi

    local spec="$root"
    [[ -n "$extras" ]] && spec="$root[$extras]"
    # One stamp per extra (and one for the core): an install with "verify,dev,app,e2e" (test.sh)
    # also satisfies a later "app" (run.sh), so nothing is installed twice.
    local want name missing=""
    want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
    for name in core ${extras//,/ }; do
        [[ "$(cat "$venv/.vramplan-install-$name" 2>/dev/null)" == "$want" ]] || missing=1
    done
    if [[ -n "$missing" ]]; then
        echo "==> pip install -e '$spec'" >&2
        "$venv/bin/python" -m pip install --quiet -e "$spec"
        for name in core ${extras//,/ }; do
            echo "$want" >"$venv/.vramplan-install-$name"
        done
    fi

    export PATH="$venv/bin:$PATH"
    export VIRTUAL_ENV="$venv"
}
