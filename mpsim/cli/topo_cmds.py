"""``topo``: the shipped servers, a topology file checked or probed, a copy's time."""

from __future__ import annotations

from pathlib import Path

import click

from mpsim import api
from mpsim.cli.options import SERVER_HELP, FiniteFloatRange, comma_list, emit, json_option


@click.group()
def topo() -> None:
    """Servers: list, show, check a topology file."""


@topo.command("list")
def topo_list() -> None:
    """The shipped servers and clusters."""
    from mpsim.views.text import servers_text

    click.echo(servers_text(api.shipped_servers(), {n: api.load_cluster(n) for n in api.shipped_clusters()}))


@topo.command("show")
@click.argument("name")
@json_option
def topo_show(name: str, json_out: str | None) -> None:
    """GPUs, the connection matrix (nvidia-smi topo -m style) and route bandwidths of NAME
    (a shipped server or a topology file); for a cluster (shipped, or a file with a
    `fabric`), its fabric and each GPU's way to another server."""
    from mpsim.views.text import cluster_text, topo_text

    if api.is_cluster(name):
        c = api.load_cluster(name)
        emit(json_out, cluster_text(c), c.to_dict())
        return
    t = api.load_topology(name)
    emit(json_out, topo_text(t), t.to_dict())


@topo.command("check")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def topo_check(file: Path) -> None:
    """Validate a topology or cluster file and print a one-line summary."""
    if api.is_cluster(str(file)):
        c = api.load_cluster(str(file))
        click.echo(f"{file}: ok ({c.describe()})")
        return
    t = api.read_topology_file(file)
    click.echo(f"{file}: ok ({t.name}, {t.n_gpus} x {t.spec.gpu.model}, {len(t.links)} directed links)")


@topo.command("probe")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="topology YAML file to write")
@click.option("--device", default="cpu", show_default=True, help="cuda: the GPUs here; cpu: CPU processes as devices")
@click.option("--devices", type=click.IntRange(min=1), default=1, show_default=True,
              help="on CPU: how many devices (one pipeline process each)")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="on CPU: threads per device")
@click.option("--memory-mib", type=FiniteFloatRange(min=1),
              help="on CPU: memory of each device  [default: RAM / devices]")
@click.option("--name", help="name stored in the file  [default: from what was found]")
def topo_probe(output: Path | None, device: str, devices: int, threads: int, memory_mib: float | None,
               name: str | None) -> None:
    """Write a topology file for the machine at hand, from measurements.

    On GPUs: count, model and memory, NVLink and PCIe layout from `nvidia-smi topo -m`,
    measured host-device and device-device copy bandwidth, device memory bandwidth and
    matmul throughput. On CPU: DEVICES processes with THREADS threads each, with measured
    matmul and memory-copy rates (what `mpsim validate --device cpu` simulates).
    """
    from mpsim.views.text import topo_text

    text, topology = api.probe_server(device, devices, threads, memory_mib, name)
    if output:
        output.write_text(text)
        click.echo(f"wrote {output}")
    click.echo(topo_text(topology))


@topo.command("transfer")
@click.option("--server", "-s", default=api.DEFAULT_SERVER, show_default=True, help=SERVER_HELP)
@click.option("--src", required=True, help="sending GPU (gpu0, 0) or host")
@click.option("--dst", help="receiving GPU or host")
@click.option("--stripe", help="comma-separated peer GPUs for a striped D2D copy, parts sized by route bandwidth")
@click.option("--size", "sizes", required=True,
              help="bytes to move, e.g. 216MB or 1.5GiB, at most 1 PiB; comma-separated for several")
@json_option
def topo_transfer(server: str, src: str, dst: str | None, stripe: str | None, sizes: str, json_out: str | None) -> None:
    """One-way time of a copy alone on an idle server, and its effective bandwidth.

    Each copy pays its route's setup latency once, so effective bandwidth rises with the
    size (as MPress Fig. 4 measures). With --stripe the copy is split over the peers in
    proportion to each route's bandwidth (MPress data striping) and lands with its last part.
    """
    from mpsim.views.text import transfer_text

    peers = None if stripe is None else comma_list(stripe, "--stripe")
    data = api.transfer(server, src, comma_list(sizes, "--size"), dst, peers)
    emit(json_out, transfer_text(data), data)


@topo.command("collective")
@click.option("--server", "-s", default=api.DEFAULT_SERVER, show_default=True, help=SERVER_HELP)
@click.option("--op", required=True, help="all-reduce, reduce-scatter, all-gather, broadcast or all-to-all")
@click.option("--size", "sizes", required=True,
              help="buffer bytes, e.g. 1GB or 256MiB, at most 1 PiB; comma-separated for several")
@click.option("--gpus", help="the group, e.g. 0-7 or 0,2,4,6 (broadcast's root is the first)  [default: every GPU]")
@click.option("--algorithm", default="ring", show_default=True,
              help="ring, or tree (NCCL's double binary tree; all-reduce only); all-to-all runs neither")
@json_option
def topo_collective(server: str, op: str, sizes: str, gpus: str | None, algorithm: str, json_out: str | None) -> None:
    """Time, algorithm and bus bandwidth of a collective alone on an idle server, as
    NCCL's ring algorithm runs it (nccl-tests' columns).

    The ring is the order of the group with the highest bottleneck bandwidth (every order
    tried for up to 8 GPUs). All-reduce is 2(n-1) steps and reduce-scatter, all-gather
    n-1 steps of SIZE/n bytes per GPU; broadcast is a pipelined chain. Each step pays the
    routes' setup latency. All-to-all runs no ring: each GPU sends SIZE/n of its SIZE
    buffer to each of the n-1 others at once, after one step of latency (NCCL's
    point-to-point sends, as nccl-tests' alltoall_perf counts SIZE). busbw = algbw x
    2(n-1)/n (all-reduce), (n-1)/n (reduce-scatter, all-gather, all-to-all), 1
    (broadcast). --algorithm tree runs all-reduce over two binary trees laid over the
    same order, half the buffer each, up and back down pipelined.
    """
    from mpsim.views.text import collective_text

    data = api.collective(server, op, comma_list(sizes, "--size"), gpus, algorithm)
    emit(json_out, collective_text(data), data)
