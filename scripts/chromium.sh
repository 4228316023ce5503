# Sourced by scripts/test.sh: make sure the Debian `chromium` package is installed for the web
# app's end-to-end test (tests/webapp/test_e2e.py drives /usr/bin/chromium with Playwright, which
# downloads no browser of its own). Fast when it is already there; installs it with apt-get when
# running as root (CI); otherwise says how, and the test skips (or fails when CI is set).

ensure_chromium() {
    if [[ -x /usr/bin/chromium ]]; then
        return 0
    fi
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        echo "==> apt-get install chromium (for the web app's end-to-end test)" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
        return $?
    fi
    echo "==> /usr/bin/chromium is missing: 'sudo apt-get install chromium' to run the end-to-end test" >&2
    return 0
}
