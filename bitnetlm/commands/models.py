"""bitnet models [--json]: the zoo's bundled, assembled and known Hub models with size, bits/weight and evals."""

from __future__ import annotations

import json

from bitnetlm import progress


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--path", metavar="NAME", help="print the local path NAME resolves to (downloads Hub models)"
    )
    progress.add_argument(p)  # --path: a zoo model assembled at first use


def _size(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _params(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 1e6:.1f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


def models_table() -> list[dict]:
    """One dict per zoo model (the library function behind `bitnet models`)."""
    from bitnetlm import zoo

    rows = []
    for e in zoo.list_models():
        d = e.to_dict()
        d["default"] = e.name == zoo.DEFAULT_MODEL
        d["available_offline"] = zoo.works_offline(e.name)
        rows.append(d)
    return rows


def run(args) -> int:
    if args.path:
        from bitnetlm.loading import resolve_path

        print(resolve_path(args.path))
        return 0
    rows = models_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ["name", "kind", "params", "bits/w", "size", "eval"]
    table = []
    for r in rows:
        ev = r.get("eval", {})
        ev_s = ", ".join(f"{k} {v}" for k, v in ev.items() if isinstance(v, (int, float))) or "-"
        name = r["name"] + (" (default)" if r["default"] else "")
        bpw = r.get("bits_per_weight")
        table.append(
            [
                name,
                r["kind"],
                _params(r.get("params")),
                f"{bpw:g}" if bpw else "-",
                _size(r.get("size_bytes")),
                ev_s,
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    for row in [header, *table]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    return 0
