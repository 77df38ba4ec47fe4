"""The HTML report of a large snapshot: page size, build time, and time to interactive in headless
Chromium (Debian's ``chromium``, driven by Playwright), over several loads.

*Interactive* is the page's own ``performance.now()`` when its script has drawn every chart and segment
map (``window.oomdoctorReady``, ms since navigation start); *wall* is Playwright's ``goto`` until that
flag is seen, which adds the browser's round trips. Usage::

    python benchmarks/bench_html_report.py [SNAPSHOT] [--repeat N] [--json OUT]

Targets: page <= 5 MB (issue 29, with the flame graphs; issue 5 asked < 10 MB), interactive < 2 s for the
271,109-event ``large`` snapshot. ``flame_json_bytes`` is the part of the page's data that the flame graphs take
(their moments' trees and anatomies, and the frame labels).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT.parent / "shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz"
sys.path.insert(0, str(ROOT / "tests" / "browser"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot", nargs="?", default=str(DEFAULT))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    from conftest import ARGS, CHROMIUM  # the browser tests' launch settings
    from pages import open_page
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.html"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; from oomdoctor.cli.main import main; sys.exit(main())", "report", args.snapshot, "-o", str(out)], check=True)
        build_s = time.perf_counter() - t0
        size = out.stat().st_size
        page = out.read_text()
        data = json.loads(page.split('<script id="oomdoctor-data" type="application/json">', 1)[1].split("</script>", 1)[0])
        flames = [v["flame"] for v in data["views"].values() if v["flame"]]
        flame_bytes = sum(len(json.dumps(f, separators=(",", ":"))) for f in flames)
        loads = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            version = browser.version
            for _ in range(args.repeat):
                r = open_page(browser, out)
                assert not r.console_errors and not r.requests, (r.console_errors, r.requests)
                loads.append({"ready_ms": round(r.ready_ms, 1), "wall_s": round(r.wall_s, 3)})
            browser.close()
    result = {
        "snapshot": args.snapshot, "page_bytes": size, "page_mib": round(size / 2**20, 3),
        "flame_json_bytes": flame_bytes, "flame_moments": sum(len(f["moments"]) for f in flames),
        "flame_nodes": sum(len(m["d"]) for f in flames for m in f["moments"]),
        "build_s_incl_startup": round(build_s, 2), "chromium": version, "loads": loads,
        "ready_ms_median": statistics.median(x["ready_ms"] for x in loads),
        "ready_ms_max": max(x["ready_ms"] for x in loads),
        "wall_s_median": statistics.median(x["wall_s"] for x in loads),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "targets": {"page_bytes_le": 5_000_000, "interactive_ms_lt": 2000},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
