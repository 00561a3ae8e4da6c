"""``fsdpsim cluster``: list the built-in clusters, or show one: its spec with the source of every
figure, and a summary of its graph for ``--nodes N`` nodes; ``--plot FILE.html`` draws the graph
(NVSwitches, GPUs, PCIe switches, NICs, leaves and spines, bottom to top) as a standalone page."""

import argparse
import importlib.util
from collections import Counter, defaultdict
from typing import Any

import networkx as nx

from sim.errors import UserError
from sim.fileio import write_text_atomic
from sim.hardware.cluster import LINK_KINDS, NODE_LAYERS, cluster_graph
from sim.hardware.cluster_spec import BUILTIN_CLUSTERS, FIELDS, ClusterSpec, load_cluster
from sim.outputs.timeline import standalone_html

DEFAULT_NODES = 2
LINK_COLOURS = {
    "nvlink": "#76b900",
    "pcie": "#888888",
    "nic": "#1f77b4",
    "leaf": "#ff7f0e",
    "spine": "#d62728",
}


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "cluster", help="list the built-in clusters, or `cluster show NAME [--nodes N] [--plot FILE.html]`"
    )
    p.add_argument("action", nargs="?", choices=("list", "show"), default="list")
    p.add_argument("name", nargs="?", help="with show: a built-in cluster name or a cluster JSON file")
    p.add_argument(
        "--nodes",
        type=int,
        default=DEFAULT_NODES,
        metavar="N",
        help="with show: nodes in the graph (default 2)",
    )
    p.add_argument("--plot", metavar="HTML", help="with show: draw the graph into a standalone HTML page")


def main(args: argparse.Namespace) -> int:
    if args.action != "show":
        print(list_text(), end="")
        return 0
    if not args.name:
        raise UserError(f"cluster show needs a cluster name; built-in: {', '.join(BUILTIN_CLUSTERS)}")
    plot = getattr(args, "plot", None)
    if plot and importlib.util.find_spec("plotly") is None:
        raise UserError("fsdpsim cluster show --plot draws with plotly: pip install -e '.[plot]'")
    spec = load_cluster(args.name, where="cluster show")
    graph = cluster_graph(spec, getattr(args, "nodes", DEFAULT_NODES))
    print(spec_text(spec) + graph_summary(graph), end="")
    if plot:
        write_graph_html(graph, plot, f"fsdp-sim cluster: {spec.name}, {graph.graph['n_nodes']} nodes")
        print(f"wrote {plot}")
    return 0


# -- text ---------------------------------------------------------------------------------------


def _gbs(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{bytes_per_s / 1e9:g} GB/s"


def list_text() -> str:
    head = f"{'name':<18}{'GPU profile':<14}{'GPUs':>5}{'NVLink/GPU':>12}{'domain':>7}  {'NICs x Gb/s':<13}"
    lines = [head + f"{'Gb/s/GPU':>9}  {'rail':<5}{'nodes/leaf':>11}{'oversub':>8}"]
    for name in BUILTIN_CLUSTERS:
        s = load_cluster(name)
        lines.append(
            f"{name:<18}{s.device_profile:<14}{s.gpus_per_node:>5}{_gbs(s.nvlink_bw_Bps):>12}{s.nvlink_domain:>7}  "
            f"{f'{s.nics_per_node} x {s.nic_gbps:g}':<13}{s.nics_per_node * s.nic_gbps / s.gpus_per_node:>9g}  "
            f"{'yes' if s.rail_optimized else 'no':<5}{s.nodes_per_leaf:>11}{s.spine_oversubscription:>8g}"
        )
    return "\n".join(lines) + "\n"


def _value(spec: ClusterSpec, key: str) -> str:
    value = getattr(spec, key)
    if key.endswith("_Bps"):
        return _gbs(value) + " per direction"
    if key == "nic_gbps":
        return f"{value:g} Gb/s ({_gbs(spec.nic_bw_Bps)} per direction)"
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def spec_text(spec: ClusterSpec) -> str:
    """Every field with its value, then the source of each."""
    keys = [k for k in FIELDS if k != "sources"]
    lines = [f"{k:<24}{_value(spec, k)}" for k in keys]
    lines += ["", "sources:"] + [f"  {k}: {spec.sources[k]}" for k in keys if k in spec.sources]
    return "\n".join(lines) + "\n\n"


def graph_summary(graph: nx.Graph) -> str:
    """Vertices by kind, then links by kind with their count and capacities."""
    kinds = Counter(kind for _, kind in graph.nodes(data="kind"))
    lines = [
        f"graph of {graph.graph['n_nodes']} nodes: {graph.number_of_nodes()} vertices, "
        f"{graph.number_of_edges()} links",
        "  vertices: " + ", ".join(f"{kinds[k]} {k}" for k in NODE_LAYERS if kinds[k]),
    ]
    links: dict[str, Counter[float]] = defaultdict(Counter)
    for _, _, d in graph.edges(data=True):
        links[d["kind"]][d["capacity_Bps"]] += 1
    for kind in (k for k in LINK_KINDS if k in links):
        caps = ", ".join(f"{n} x {_gbs(c)}" for c, n in sorted(links[kind].items()))
        lines.append(f"  {kind:<7}{sum(links[kind].values()):>6} links: {caps} per direction")
    return "\n".join(lines) + "\n"


# -- drawing ------------------------------------------------------------------------------------


def _positions(graph: nx.Graph) -> dict[Any, tuple[float, float]]:
    """Each layer on its own row, its vertices spread evenly in (node, index) order."""
    rows: dict[int, list[Any]] = defaultdict(list)
    for n, layer in graph.nodes(data="layer"):
        rows[layer].append(n)
    return {
        n: ((i + 0.5) / len(row), float(layer))
        for layer, row in rows.items()
        for i, n in enumerate(sorted(row, key=lambda v: v[1:]))
    }


def _edge_trace(graph: nx.Graph, pos: dict[Any, tuple[float, float]], kind: str) -> Any:
    import plotly.graph_objects as go

    xs: list[float | None] = []
    ys: list[float | None] = []
    edges = [(a, b, d) for a, b, d in graph.edges(data=True) if d["kind"] == kind]
    for a, b, _ in edges:
        xs += [pos[a][0], pos[b][0], None]
        ys += [pos[a][1], pos[b][1], None]
    caps = sorted({d["capacity_Bps"] for _, _, d in edges})
    label = f"{kind}: {len(edges)} links, " + ", ".join(_gbs(c) for c in caps)
    line = dict(width=1, color=LINK_COLOURS[kind])
    return go.Scatter(x=xs, y=ys, mode="lines", line=line, name=label, hoverinfo="skip")


def _node_trace(graph: nx.Graph, pos: dict[Any, tuple[float, float]], kind: str) -> Any:
    import plotly.graph_objects as go

    nodes = [n for n, k in graph.nodes(data="kind") if k == kind]
    text = [f"{' '.join(map(str, n))}: {graph.degree(n)} links" for n in nodes]
    return go.Scatter(
        x=[pos[n][0] for n in nodes],
        y=[pos[n][1] for n in nodes],
        mode="markers",
        marker=dict(size=8, symbol="square" if kind != "gpu" else "circle"),
        name=f"{kind} ({len(nodes)})",
        text=text,
        hoverinfo="text",
    )


def graph_figure(graph: nx.Graph, title: str) -> Any:
    """The plotly figure of the graph: one row per layer, links coloured by kind."""
    import plotly.graph_objects as go

    pos = _positions(graph)
    present = {k for _, _, k in graph.edges(data="kind")}
    traces = [_edge_trace(graph, pos, k) for k in LINK_KINDS if k in present]
    kinds = {k for _, k in graph.nodes(data="kind")}
    traces += [_node_trace(graph, pos, k) for k in NODE_LAYERS if k in kinds]
    fig = go.Figure(traces)
    rows = sorted({layer for _, layer in graph.nodes(data="layer")})
    names = {layer: "/".join(k for k, v in NODE_LAYERS.items() if v == layer) for layer in rows}
    fig.update_yaxes(tickvals=rows, ticktext=[names[r] for r in rows], zeroline=False)
    fig.update_xaxes(visible=False)
    fig.update_layout(title=dict(text=title), template="plotly_white", height=650)
    return fig


def write_graph_html(graph: nx.Graph, path: str, title: str) -> None:
    """The drawing as one offline HTML page (plotly.js embedded), written atomically."""
    write_text_atomic(path, standalone_html(graph_figure(graph, title), title))
