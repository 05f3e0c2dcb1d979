"""Write `template.html`, the page `dvc plots show` fills (`.dvc/config` `plots.html_template`).

DVC's own page loads Vega from a CDN, so it stays blank offline. This template leaves out DVC's
`{scripts}` placeholder (the CDN tags) and inlines the three vendored scripts beside this file
instead: `dvc plots show` writes `dvc_plots/index.html` under whatever folder it runs in (the
repo root or a pipeline folder), so a relative `<script src>` could not reach this folder from
both, while an inlined page renders anywhere, with no network. Rerun after updating a script:

    python plots/vendor/build_template.py
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
# Load order matters: vega-embed's UMD wrapper reads the globals `vega` and `vegaLite`.
SCRIPTS = ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js")

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {{refresh_tag}}
    <title>DVC Plot</title>
{scripts}
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def build() -> str:
    tags = []
    for name in SCRIPTS:
        code = (HERE / name).read_text(encoding="utf-8")
        tags.append(f'    <script type="text/javascript" data-vendored="{name}">\n{code}\n'
                    f"    </script>")
    return PAGE.format(scripts="\n".join(tags))


if __name__ == "__main__":
    (HERE / "template.html").write_text(build(), encoding="utf-8")
    print(HERE / "template.html")
