"""``serve``: the local web page (:mod:`mpsim.web`)."""

from __future__ import annotations

import signal
import sys

import click


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; 127.0.0.1 is this machine only (anything else lets others run jobs)")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="port to listen on; 0 picks a free one, printed at start")
@click.option("--verbose", is_flag=True, help="log every request on stderr")
def serve(host: str, port: int, verbose: bool) -> None:
    """A local web page over the same API: pick or upload a server and a model, run, and see
    the verdict, per-GPU memory, memory over time, the pipeline timeline and the plan.

    Works offline (the page and its script come with the package). Ctrl-C or SIGTERM
    stops it and removes its uploads.
    """
    from mpsim.web.app import make_server

    server = make_server(host, port, verbose)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds through the cleanup
    click.echo(f"mpsim serve: {server.url} (Ctrl-C to stop)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
