"""Screenshots of the web calculator's main views for the README (``docs/app-*.png``), taken in
headless Debian Chromium from the real server (``webapp.browser``).

    python scripts/screenshots.py [--out docs]

Needs ``/usr/bin/chromium`` and ``pip install '.[app,e2e]'`` (``bash scripts/test.sh`` installs
both).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from webapp import browser

ROOT = Path(__file__).resolve().parent.parent
VIEWS: tuple[tuple[str, str, str], ...] = (
    (
        "app-calculator.png",
        "/?card=llama-3.1-8b&gpu=h100-80gb&precision=bf16&optimizer=adam8bit&recompute=full"
        "&micro_batch=4&seq_len=4096",
        browser.VERDICT,
    ),
    (
        "app-inference.png",
        "/?task=infer&card=qwen2.5-32b&gpu=h200-141gb&batch=16&context=8192",
        browser.VERDICT,
    ),
    (
        "app-parallel.png",
        "/?card=qwen2.5-7b&gpu=h100-80gb&precision=bf16-master&implementation=reference"
        "&micro_batch=4&pp=4&pp_microbatches=4",
        browser.VERDICT,
    ),
    (
        "app-planner.png",
        "/planner?card=qwen2.5-7b&gpu=h200-141gb&explore=precision,recompute&global_batch=8",
        "configurations fit",
    ),
    ("app-verification.png", "/verification", "Predicted vs measured"),
)
"""(file, path and query of the view, text to wait for)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with browser.server() as url, browser.browser_page(width=1400, height=3200) as page:
        for name, path, wait_for in VIEWS:
            browser.load(page, url + path, wait_for, timeout_s=900)
            bottom = page.evaluate(  # type: ignore[attr-defined]
                "() => document.querySelector('[data-testid=\"stMainBlockContainer\"]')"
                ".getBoundingClientRect().bottom"
            )
            clip = {"x": 0, "y": 0, "width": 1400, "height": min(3200, int(bottom) + 24)}
            page.screenshot(path=str(args.out / name), clip=clip)  # type: ignore[attr-defined]
            print(f"{args.out / name}: {clip['height']} px high")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
