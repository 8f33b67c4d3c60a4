"""Pictures of a pool's memory from `Pool.layout()` dicts (matplotlib, no display).

`plot_memory_map(layout)` draws the pages of each region as a grid of cells,
`pages_per_row` cells to a row; inside a cell x is the offset within the page
(left edge = offset 0, right edge = the page's end). Colours (`COLORS`):

- ``live``: a live block; ``pinned``: a pinned live block (never moves);
- ``retired``: an old location whose data a compaction moved, not yet released;
- ``stranded``: free space inside a page that holds live data (what
  compaction recovers);
- ``empty``: a mapped page holding no block;
- ``unmapped``: a virtual page with no physical page behind it;
- ``offloaded``: a page backed by host memory (`pool.offload`), with its
  blocks; ``asleep``: a page whose device memory `pool.sleep()` released
  (its blocks keep their places and come back at `wake()`);
- ``cached``: physical pages held but mapped nowhere have no address, so they
  are a count in the title, not cells;
- meshes (`Pool.mesh`: one physical page mapped at several pages): a
  ``twin`` page (hatched) shows its own blocks on the physical page of its
  mesh's *primary*; ``twin-held`` marks the bytes of a primary that its twins'
  blocks use; a ``dormant`` twin maps a mesh's page and holds no block. A
  line joins each twin to its primary and every member is labelled with its
  mesh id (`layout()["regions"][i]["meshes"]`); over `MAX_JOINS` meshes the
  lines are left out and over `MAX_MESH_LABELS` the labels too (the title
  says so). The title counts physical pages: a mesh is one mapped page.

The legend lists only the states that appear in the drawn picture.

Blocks narrower than `MIN_BLOCK_FRACTION` of a page are drawn that wide so
that they stay visible; the white seams between blocks are drawn inside them.
A region can have thousands of pages: only pages up to the last mapped one,
plus one row of margin, are drawn (at most `max_pages` per region), and the
title says how many.

Everything works from plain dicts (a layout saved as JSON and loaded back
works too), so pictures can be made anywhere. Figures are built on the Agg
canvas directly: importing this module changes no matplotlib backend.
"""

from __future__ import annotations

import math
import os
import textwrap

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .stats import mesh_groups
from .units import format_bytes

COLORS = {
    "live": "#4e79a7",      # blue
    "pinned": "#e15759",    # red
    "retired": "#f28e2b",   # orange
    "stranded": "#edc948",  # yellow
    "empty": "#8cd17d",     # light green
    "unmapped": "#d9d9d9",  # light grey
    "cached": "#9c755f",    # brown (not drawn: cached pages have no address; kept for callers' own legends)
    "offloaded": "#b07aa1",  # purple: a page backed by host memory (pool.offload), its blocks too
    "asleep": "#76b7b2",     # teal: a page released by pool.sleep(), mapped again at wake
    "twin": "#c5b0e6",       # lavender, hatched: a twin page of a mesh (its blocks drawn on top)
    "twin-held": "#9d7fd0",  # darker lavender: bytes of a primary page that its twins' blocks use
    "dormant": "#ebe3f5",    # pale lavender, hatched: a twin page holding no block
}
HATCHES = {"twin": "////", "dormant": "...."}
MESH_LINE = "#5b3a8c"  # the lines joining twins to primaries, and the mesh labels
LABELS = {
    "live": "live block",
    "pinned": "pinned block",
    "retired": "moved away, awaiting release",
    "stranded": "stranded free space (page holds live data)",
    "empty": "empty mapped page (no block)",
    "unmapped": "unmapped page",
    "offloaded": "offloaded to host memory (same addresses)",
    "asleep": "asleep (device page released until wake)",
    "twin": "twin page (meshed): its blocks, stored in its primary's physical page",
    "twin-held": "in a primary page: bytes its twins' blocks use",
    "dormant": "dormant twin: maps a meshed page, holds no block",
}
JOIN_RISE = 0.4  # of a row: how high the join of two neighbouring pages rises above the cells (twice at most)
MAX_JOINS = 64  # meshes drawn with lines from twins to primary; above, labels only
MAX_MESH_LABELS = 256  # member cells labelled with their mesh id; above, neither lines nor labels

# What a compaction does, under the before/after caption: the picture shows it, the words must say it.
COMPACTION_NOTE = ("compaction packs: it moves tensors out of sparse pages into the holes of fuller pages "
                   "(it does not slide them to one end); the pages it empties stay mapped and free, and their "
                   "physical pages can back any later request, stitched into one virtual range")

CELL_WIDTH = 0.94  # of one x unit per page; the rest is a white gap
ROW_HEIGHT = 0.78  # of one y unit per row
MIN_BLOCK_FRACTION = 0.012  # of a page: the narrowest block drawn
SEAM = 0.01  # of a page (about a pixel): white line at the left edge of a block that starts inside a page
DPI = 100


def layout_totals(layout: dict) -> dict:
    """Headline numbers of a layout: pages mapped/live/empty (physical pages: a mesh counts once),
    allocated and stranded bytes, fragmentation (stranded / mapped), cached pages, and the meshes:
    `meshes` (physical pages shared), `pages_meshed` (the virtual pages on them), `pages_twin`."""
    P = int(layout["page_size"])
    states = [s for r in layout["regions"] for s in r["pages"]]
    twins, meshes, members = set(), 0, 0
    live_meshes = set()  # (region, primary) of meshes with a block on any member
    for r in layout["regions"]:
        for group in mesh_groups(r).values():
            meshes += 1
            members += len(group)
            twins.update((int(r["index"]), t) for t in group[1:])
            if any(r["pages"][p] in ("live", "meshed") for p in group):
                live_meshes.add((int(r["index"]), group[0]))
    mapped = sum(s != "unmapped" for s in states) - len(twins)
    on_device = {(int(r["index"]), i) for r in layout["regions"] for i, s in enumerate(r["pages"])
                 if s == "live" or (int(r["index"]), i) in live_meshes}
    live_pages = len(on_device)
    on_device |= {(int(r["index"]), i) for r in layout["regions"] for i, s in enumerate(r["pages"]) if s == "meshed"}
    away = sum(s in ("offloaded", "asleep") for s in states)
    held = sum(int(b["size"]) for b in layout["blocks"]
               if (int(b["region"]), (int(b["address"]) - _base(layout, b)) // P) in on_device)
    allocated = sum(int(b["size"]) for b in layout["blocks"] if b.get("state", "live") == "live")
    stranded = live_pages * P - held  # every block lies in live pages (twins' in their primaries')
    return {
        "pages_mapped": mapped - away, "pages_live": live_pages, "pages_empty": mapped - away - live_pages,
        "pages_offloaded": sum(s == "offloaded" for s in states), "pages_asleep": sum(s == "asleep" for s in states),
        "pages_cached": int(layout.get("cached_pages", 0)), "allocated": allocated, "stranded": stranded,
        "fragmentation": stranded / ((mapped - away) * P) if mapped - away else 0.0, "page_size": P,
        "meshes": meshes, "pages_meshed": members, "pages_twin": len(twins),
    }


def _base(layout: dict, block: dict) -> int:
    return next(int(r["base"]) for r in layout["regions"] if int(r["index"]) == int(block["region"]))


def _shown_pages(region: dict, pages_per_row: int, max_pages: int) -> int:
    """Pages of a region to draw: up to the last mapped page plus one row, whole rows, capped."""
    used = [i for i, s in enumerate(region["pages"]) if s != "unmapped"]
    last = used[-1] + 1 if used else 0
    want = math.ceil(last / pages_per_row) * pages_per_row + pages_per_row
    return max(1, min(len(region["pages"]), want, max_pages))


def _plan(layout: dict, pages_per_row: int, max_pages: int, shown: dict | None = None) -> list[tuple[dict, int, int]]:
    """(region, pages shown, first row) for each region."""
    out, row = [], 0
    for region in layout["regions"]:
        n = (shown or {}).get(int(region["index"])) or _shown_pages(region, pages_per_row, max_pages)
        n = min(n, len(region["pages"]))
        out.append((region, n, row))
        row += math.ceil(n / pages_per_row)
    return out


def _rect(x0: float, x1: float, y: float) -> list[tuple[float, float]]:
    return [(x0, y), (x1, y), (x1, y + ROW_HEIGHT), (x0, y + ROW_HEIGHT)]


def _headroom(*layouts: dict) -> float:
    """Rows of room above the first row for the joins of meshes, when some layout has meshes."""
    return 2 * JOIN_RISE if any(r.get("meshes") for lay in layouts for r in lay["regions"]) else 0.0


def _draw(ax, layout: dict, *, pages_per_row: int, max_pages: int, shown: dict | None = None,
          title: str | None = None, headroom: float | None = None) -> dict:
    """Draw `layout` into `ax`; returns what was drawn (rows, hidden pages, totals, and `kinds`:
    the states visible in the picture, for the legend)."""
    P = int(layout["page_size"])
    plan = _plan(layout, pages_per_row, max_pages, shown)
    polys: dict[str, list] = {k: [] for k in COLORS}
    seams: list = []

    def cell(page: int, first_row: int) -> tuple[float, float]:
        return page % pages_per_row, first_row + page // pages_per_row

    # Meshes: per region, mesh id -> [primary, twins...], and each member's mesh.
    groups = {int(r["index"]): mesh_groups(r) for r, _, _ in plan}
    member = {(i, p): (m, g[0]) for i, gs in groups.items() for m, g in gs.items() for p in g}
    live_mesh = {(i, m) for i, gs in groups.items() for m, g in gs.items()
                 if any(next(r for r, _, _ in plan if int(r["index"]) == i)["pages"][p] in ("live", "meshed")
                        for p in g)}

    # Cells: the page's state colours the whole cell; blocks are drawn on top,
    # so what stays visible in a live page is its stranded free space.
    yticks, ylabels = [], []
    for region, n, first_row in plan:
        for page in range(n):
            state = region["pages"][page]
            x, y = cell(page, first_row)
            kind = {"live": "stranded", "empty": "empty", "offloaded": "offloaded", "asleep": "asleep",
                    "meshed": "twin", "meshed-dormant": "dormant"}.get(state, "unmapped")
            mesh = member.get((int(region["index"]), page))
            if mesh and mesh[1] == page and (int(region["index"]), mesh[0]) in live_mesh:
                kind = "stranded"  # a primary whose physical page holds its twins' blocks if not its own
            polys[kind].append(_rect(x, x + CELL_WIDTH, y))
        for r in range(math.ceil(n / pages_per_row)):
            yticks.append(first_row + r + ROW_HEIGHT / 2)
            ylabels.append(f"R{region['index']} p{r * pages_per_row}")

    covered = _block_polys(layout, plan, member, polys, seams, cell)

    for kind in ("unmapped", "empty", "stranded", "asleep", "offloaded", "twin", "dormant", "twin-held",
                 "live", "pinned", "retired"):
        if polys[kind]:
            ax.add_collection(_collection(polys[kind], kind))
    if seams:
        ax.add_collection(PolyCollection(seams, facecolors="white", edgecolors="none", linewidths=0,
                                         antialiased=False))
    joins, marks = _draw_joins(ax, plan, groups, pages_per_row)

    # What is visible: a state whose polygons were drawn; stranded space only where a
    # drawn page holding live data is not covered by its blocks.
    kinds = {k for k in ("live", "pinned", "retired", "empty", "unmapped", "offloaded", "asleep", "twin",
                         "twin-held", "dormant") if polys[k]}
    if any((region["pages"][page] == "live" or (int(region["index"]), page) in
            {(i, groups[i][m][0]) for i, m in live_mesh})
           and covered.get((int(region["index"]), page), 0) < P
           for region, n, _ in plan for page in range(n)):
        kinds.add("stranded")
    kinds |= marks

    rows, hidden, totals = _frame(ax, layout, plan, pages_per_row, yticks, ylabels, title, headroom, joins)
    return {"rows": rows, "hidden_pages": hidden, "totals": totals, "plan": plan, "kinds": kinds}


def _block_polys(layout: dict, plan, member: dict, polys: dict, seams: list, cell) -> dict:
    """Every block's rectangles, split at page boundaries, into `polys` (by colour) and `seams`; a twin's
    pieces are also marked in its primary's cell. Returns the bytes drawn per (region, page)."""
    P = int(layout["page_size"])
    rows_of = {int(region["index"]): (region, n, first_row) for region, n, first_row in plan}
    covered: dict[tuple[int, int], int] = {}  # (region, page) -> bytes of blocks drawn in it
    for b in layout["blocks"]:
        region, n, first_row = rows_of.get(int(b["region"]), (None, 0, 0))
        if region is None:
            continue
        if b.get("kind") == "filler":
            continue  # space held unused on an offloaded page: the page's colour shows it
        kind = "retired" if b.get("state", "live") != "live" else ("pinned" if b.get("pinned") else "live")
        if b.get("offloaded"):
            kind = "offloaded"
        start = int(b["address"]) - int(region["base"])
        end = start + int(b["size"])
        for page in range(start // P, (end - 1) // P + 1):
            lo = max(start, page * P) - page * P
            hi = min(end, (page + 1) * P) - page * P
            mesh = member.get((int(region["index"]), page))
            if mesh and mesh[1] != page and mesh[1] < n:  # a twin's piece: held in its primary's page
                key = (int(region["index"]), mesh[1])
                covered[key] = covered.get(key, 0) + hi - lo
                x, y = cell(mesh[1], first_row)
                polys["twin-held"].append(_rect(x + lo / P * CELL_WIDTH, x + hi / P * CELL_WIDTH, y))
            if page >= n:
                continue
            key = (int(region["index"]), page)
            covered[key] = covered.get(key, 0) + hi - lo
            f0, f1 = lo / P, hi / P
            if f1 - f0 < MIN_BLOCK_FRACTION:
                f1 = min(1.0, f0 + MIN_BLOCK_FRACTION)
                f0 = f1 - MIN_BLOCK_FRACTION
            x, y = cell(page, first_row)
            polys[kind].append(_rect(x + f0 * CELL_WIDTH, x + f1 * CELL_WIDTH, y))
            if lo > 0 and f1 - f0 > 4 * MIN_BLOCK_FRACTION:  # separates it from a block just before
                seams.append(_rect(x + f0 * CELL_WIDTH, x + (f0 + SEAM) * CELL_WIDTH, y))
    return covered


def _frame(ax, layout: dict, plan, pages_per_row: int, yticks, ylabels, title, headroom, joins: str):
    """Axes limits, ticks and the title with the pool's totals; returns (rows, hidden pages, totals)."""
    P = int(layout["page_size"])
    rows = sum(math.ceil(n / pages_per_row) for _, n, _ in plan)
    ax.set_xlim(-0.03, pages_per_row - (1 - CELL_WIDTH) + 0.03)
    headroom = _headroom(layout) if headroom is None else headroom
    ax.set_ylim(rows - (1 - ROW_HEIGHT) + 0.1, -0.1 - headroom)  # row 0 on top
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_xticks([])
    ax.set_xlabel(f"each cell is one {format_bytes(P)} page; x = offset within the page", fontsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(axis="y", length=0)

    totals = layout_totals(layout)
    hidden = sum(len(r["pages"]) - n for r, n, _ in plan)
    if title is None:
        title = f"defrag pool #{layout.get('pool', '?')} ({layout.get('kind', '?')})"
    head = (f"{totals['pages_mapped']} pages mapped ({format_bytes(totals['pages_mapped'] * P)}), "
            f"{format_bytes(totals['allocated'])} live, {format_bytes(totals['stranded'])} stranded "
            f"({totals['fragmentation']:.1%}), {totals['pages_cached']} cached"
            + (f", {totals['pages_offloaded']} offloaded" if totals["pages_offloaded"] else "")
            + (f", {totals['pages_asleep']} asleep" if totals["pages_asleep"] else "")
            + (f"\n{totals['pages_meshed']} pages meshed onto {totals['meshes']} physical pages (counted once above)"
               + joins if totals["meshes"] else ""))
    shown_note = ""
    if hidden:
        shown_note = (f"\nshowing {sum(n for _, n, _ in plan)} of {sum(len(r['pages']) for r in layout['regions'])} "
                      f"virtual pages (the rest are unmapped or past the cap)")
    ax.set_title(f"{title}\n{head}{shown_note}", fontsize=9)
    return rows, hidden, totals


def _collection(polys: list, kind: str) -> PolyCollection:
    """The cells or blocks of one colour; twins' cells hatched."""
    hatch = HATCHES.get(kind)
    if hatch is None:
        return PolyCollection(polys, facecolors=COLORS[kind], edgecolors="none", linewidths=0, antialiased=False)
    return PolyCollection(polys, facecolors=COLORS[kind], edgecolors=MESH_LINE, linewidths=0, hatch=hatch,
                          antialiased=False)


def _draw_joins(ax, plan, groups: dict, pages_per_row: int) -> tuple[str, set]:
    """Each drawn mesh: its id on each member cell, and an arc from each twin to its primary in the same
    row (above the cells' top edge). Returns a note for the title on what was left out (too many to read),
    and what was drawn: {"labels"} and "joins" if lines."""
    drawn = []  # (mesh id, [(x, y) of each drawn member's top centre], primary first)
    for region, n, first_row in plan:
        for m, group in groups.get(int(region["index"]), {}).items():
            at = [(p % pages_per_row + CELL_WIDTH / 2, first_row + p // pages_per_row) for p in group if p < n]
            if at:
                drawn.append((m, group[0] < n, at))
    if not drawn:
        return "", set()
    labels = sum(len(at) for _, _, at in drawn)
    if labels > MAX_MESH_LABELS:
        return f" ({len(drawn)} meshes shown: too many to label or join)", set()
    for m, _, at in drawn:
        for k, (x, y) in enumerate(at):
            ax.text(x - CELL_WIDTH / 2 + 0.02, y + 0.04, f"m{m}" + ("" if k else "*"), fontsize=6,
                    color=MESH_LINE, va="top", ha="left", weight="bold",
                    bbox={"boxstyle": "square,pad=0.08", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    if len(drawn) > MAX_JOINS:
        return f" ({len(drawn)} meshes shown: labelled, joined by no line above {MAX_JOINS})", {"labels"}
    lines = []
    for _, has_primary, at in drawn:
        if not has_primary:
            continue
        (x0, y0), twins = at[0], at[1:]
        for x1, y1 in twins:
            if y1 != y0:
                continue  # across rows a line would cross other pages' cells: the labels say it
            # A quadratic arc between the cells' top edges, bowing up into the gap above the rows (higher
            # for farther pages, so that nested joins stay apart).
            mx, my = (x0 + x1) / 2, min(y0, y1) - 2 * JOIN_RISE * min(0.25 + abs(x1 - x0) / pages_per_row, 1)
            pts = [((1 - t) ** 2 * x0 + 2 * (1 - t) * t * mx + t * t * x1,
                    (1 - t) ** 2 * y0 + 2 * (1 - t) * t * my + t * t * y1) for t in (i / 16 for i in range(17))]
            lines.append(pts)
    if not lines:
        return "", {"labels"}
    ax.add_collection(LineCollection(lines, colors=MESH_LINE, linewidths=1.2, alpha=0.9))
    ends = [pt for line in lines for pt in (line[0], line[-1])]
    ax.plot([x for x, _ in ends], [y for _, y in ends], "o", color=MESH_LINE, markersize=2.5)
    return "", {"labels", "joins"}


def _legend_handles(kinds, cached_pages: int = 0) -> list:
    """One swatch per state in `kinds` (those visible in the picture), in the order of `LABELS`; then,
    when the titles count cached pages, a line without a swatch that says what they are (they have no cell)."""
    handles = [Patch(facecolor=COLORS[k], label=LABELS[k], hatch=HATCHES.get(k),
                     edgecolor=MESH_LINE if k in HATCHES else None, linewidth=0) for k in LABELS if k in kinds]
    if kinds & {"joins", "labels"}:
        handles.append(Patch(facecolor="none", edgecolor="none", label=(
            "m3*, m3: primary, twin of mesh 3 (one physical page)"
            + ("; a line joins them in one row" if "joins" in kinds else ""))))
    if cached_pages:
        handles.append(Patch(facecolor="none", edgecolor="none",
                             label="cached (counted above): physical pages held but mapped nowhere, so no cell"))
    return handles


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path) -> str:
    path = os.fspath(path)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def plot_memory_map(layout: dict, path=None, ax=None, title: str | None = None, *,
                    pages_per_row: int = 8, max_pages: int = 512):
    """Draw a pool memory map from a `Pool.layout()` dict (see the module doc for the colours).

    With `ax`, draws into it (with a legend inside the axes); otherwise makes
    a new figure. With `path`, writes a PNG there and returns the path;
    otherwise returns the figure. `pages_per_row` cells per row; at most
    `max_pages` pages per region are drawn.
    """
    if pages_per_row < 1 or max_pages < 1:
        raise ValueError("pages_per_row and max_pages must be >= 1")
    if ax is not None:
        drawn = _draw(ax, layout, pages_per_row=pages_per_row, max_pages=max_pages, title=title)
        ax.legend(handles=_legend_handles(drawn["kinds"], drawn["totals"]["pages_cached"]), fontsize=7,
                  loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig = ax.figure
        return _save(fig, path) if path is not None else fig
    rows = sum(math.ceil(n / pages_per_row) for _, n, _ in _plan(layout, pages_per_row, max_pages))
    rows += _headroom(layout)
    top, bottom = 0.9, 1.05  # inches: title; x label and legend
    height = top + bottom + 0.45 * rows
    fig = _new_figure(1.5 * pages_per_row + 1.0, height)
    ax = fig.add_axes((0.8 / fig.get_figwidth(), bottom / height, 1 - 1.0 / fig.get_figwidth(),
                       0.45 * rows / height))
    drawn = _draw(ax, layout, pages_per_row=pages_per_row, max_pages=max_pages, title=title)
    fig.legend(handles=_legend_handles(drawn["kinds"], drawn["totals"]["pages_cached"]), loc="lower center",
               ncol=3, fontsize=8, frameon=False)
    return _save(fig, path) if path is not None else fig


def _report_dict(report) -> dict:
    if report is None:
        return {}
    if isinstance(report, dict):
        return report
    if hasattr(report, "as_dict"):
        return report.as_dict()
    return dict(vars(report))


def plot_compaction(before_layout: dict, after_layout: dict, path=None, report=None, *,
                    pages_per_row: int = 8, max_pages: int = 512):
    """Before/after memory maps side by side, with the compaction's headline as a caption.

    `report`: a `CompactionReport` or its `as_dict()`; without one the caption
    is computed from the two layouts (moved bytes unknown then). Both maps
    show the same page range so that they compare cell for cell. With `path`,
    writes a PNG and returns the path; otherwise returns the figure.
    """
    r = _report_dict(report)
    tb, ta = layout_totals(before_layout), layout_totals(after_layout)
    if r:
        caption = (f"moved {r.get('moved_tensors', 0)} tensors / {format_bytes(r.get('moved_bytes', 0))}; "
                   f"pages holding live data {r.get('pages_before', tb['pages_mapped'])} -> "
                   f"{r.get('pages_after', ta['pages_mapped'])}; fragmentation "
                   f"{r.get('fragmentation_before', tb['fragmentation']):.1%} -> "
                   f"{r.get('fragmentation_after', ta['fragmentation']):.1%}")
        if r.get("meshed_pages"):
            caption += (f"; meshed {r['meshed_pages']} pages onto others' physical pages "
                        f"({r.get('mesh_freed_pages', 0)} freed)")
        if r.get("seconds"):
            caption += f"; {r['seconds'] * 1e3:.1f} ms ({'automatic' if r.get('automatic') else 'explicit'})"
    else:
        caption = (f"mapped pages {tb['pages_mapped']} -> {ta['pages_mapped']}; fragmentation "
                   f"{tb['fragmentation']:.1%} -> {ta['fragmentation']:.1%}")
    # The same page range on both sides.
    shown = {}
    for layout in (before_layout, after_layout):
        for region in layout["regions"]:
            i = int(region["index"])
            shown[i] = max(shown.get(i, 1), _shown_pages(region, pages_per_row, max_pages))
    rows = max(sum(math.ceil(n / pages_per_row) for _, n, _ in _plan(l, pages_per_row, max_pages, shown))
               for l in (before_layout, after_layout))
    headroom = _headroom(before_layout, after_layout)
    rows += headroom
    panel = 1.0 * pages_per_row
    width = 2 * panel + 2.0
    note = textwrap.wrap(COMPACTION_NOTE, max(40, int(width * 8)))  # two balanced lines at 9 pt
    top, bottom = 1.3 + 0.18 * len(note), 1.0  # inches: caption, note and titles; x label and legend
    height = top + bottom + 0.45 * rows
    fig = _new_figure(width, height)
    kinds: set = set()
    cached = 0
    for k, (layout, name) in enumerate(((before_layout, "before"), (after_layout, "after"))):
        left = (0.8 + k * (panel + 0.8)) / width
        ax = fig.add_axes((left, bottom / height, panel / width, 0.45 * rows / height))
        drawn = _draw(ax, layout, pages_per_row=pages_per_row, max_pages=max_pages, shown=shown,
                      title=f"{name} compaction", headroom=headroom)
        kinds |= drawn["kinds"]
        cached = max(cached, drawn["totals"]["pages_cached"])
    fig.legend(handles=_legend_handles(kinds, cached), loc="lower center", ncol=3,
               fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.text(0.5, 1 - 0.25 / height, caption, ha="center", va="top", fontsize=10, weight="bold")
    fig.text(0.5, 1 - 0.55 / height, "\n".join(note), ha="center", va="top", fontsize=9)
    return _save(fig, path) if path is not None else fig
