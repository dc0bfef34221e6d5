"""Writes docs/options.md, the options reference, from the option declarations (serving/options.py
reads each config dataclass's fields; this prints them). tests/test_docs.py fails when the page
differs from what this writes, so a new or changed option shows up in the docs with its change.

    .venv/bin/python scripts/options_reference.py            # rewrite docs/options.md
    .venv/bin/python scripts/options_reference.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_ONLY = ("Server process", "`pdserve up`")  # sections that no Serve config has
PAGE = ROOT / "docs" / "options.md"


def sections() -> list[tuple[str, str, list[type]]]:
    """(title, where it applies, the config classes) per section of the page; a section whose
    where names no Serve config has no Serve keys."""
    from decode_node.config import DecodeConfig
    from engine import EngineConfig
    from kvtransfer import transports
    from kvtransfer.security import SecurityConfig
    from pdserve.up import UpConfig
    from prefill_node.config import PrefillConfig
    from router.config import RouterConfig
    from serving.process import ProcessConfig

    return [
        (
            "Engine",
            "every command that runs an engine (`pdserve up`, `colocated`, `generate-offline`, "
            "`python -m prefill_node` / `decode_node`); in a Serve config, `args.prefill.engine` and "
            "`args.decode.engine`; in Python, `EngineConfig` (and `LLM(...)`'s keywords)",
            [EngineConfig],
        ),
        ("Router", "`python -m router` and `pdserve up`; `args.router` in a Serve config", [RouterConfig]),
        (
            "Prefill node",
            "`python -m prefill_node` (`pdserve up` forwards them); `args.prefill` in a Serve config",
            [PrefillConfig, *transports.sender_options()],
        ),
        (
            "Decode node",
            "`python -m decode_node` (`pdserve up` forwards them); `args.decode` in a Serve config",
            [DecodeConfig, *transports.reader_options()],
        ),
        (
            "Security (internal ports)",
            "every node and the router (`pdserve up` forwards them); `args.security` in a Serve config",
            [SecurityConfig],
        ),
        (
            "Server process",
            "each server process's command line (not in a Serve config: Ray places the replicas)",
            [ProcessConfig],
        ),
        ("`pdserve up`", "`pdserve up` only (not in a Serve config)", [UpConfig]),
    ]


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(opt) -> str:
    value = opt.to_cli(opt.default)
    if value is None:
        return "none"
    if opt.kind is bool:
        return "on" if value else "off"
    if opt.kind is dict:
        return f"`{value}`" if value else "`{}`"
    return f"`{value}` GiB" if opt.unit == 2**30 else f"`{value}`"


def render() -> str:
    from serving.options import options

    lines = [
        "# Options reference",
        "",
        "Every option of every component, generated from their declarations by "
        "`scripts/options_reference.py` (a test fails when this page is stale). Each option is one "
        "field of a config dataclass: its command-line flag and its key in a Serve config section "
        "are the same option ([Ray Serve](ray_serve.md)). Sizes given in GiB on the command line "
        "are bytes in Python and in a Serve config. A flag `--no-X` turns off an option that is on by default.",
        "",
    ]
    for title, where, classes in sections():
        lines += [f"## {title}", "", f"Where: {where}.", "", "| flag | Serve key | default | what it does |"]
        lines.append("| --- | --- | --- | --- |")
        seen = set()
        for cls in classes:
            for opt in options(cls):
                if opt.name in seen:
                    continue
                seen.add(opt.name)
                flag = f"`{opt.flag}`" if "cli" in opt.where else "—"
                key = f"`{opt.key}`" if "serve" in opt.where and title not in CLI_ONLY else "—"
                text = opt.help + (f" (one of {', '.join(map(str, opt.choices))})" if opt.choices else "")
                lines.append(f"| {flag} | {key} | {_default(opt)} | {_cell(text)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/options.md differs, write nothing")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/options_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
