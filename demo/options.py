"""Command-line options of ``kvbroker demo``."""

from __future__ import annotations

import argparse

__all__ = ["add_demo_arguments"]


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--rooms", type=int, default=16, help="requests (rooms) to move")
    g.add_argument("--layers", type=int, default=8, help="model layers")
    g.add_argument("--pages", type=int, default=24, help="KV pages per room")
    g.add_argument("--page-size", type=int, default=16, help="tokens per page")
    g.add_argument("--kv-heads", type=int, default=None, help="total KV heads of the model (default 8; 1 with --mla)")
    g.add_argument("--head-dim", type=int, default=None, help="head dim (default 64; 576 with --mla)")
    g.add_argument("--dtype", default="bfloat16", help="KV dtype (torch name)")
    g.add_argument("--mla", action="store_true", help="MLA layout: one latent KV region per layer")
    g.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of the prefill engine")
    g.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of the decode engine")
    g.add_argument("--prefill-pp", type=int, default=1, help="pipeline-parallel size of the prefill engine")
    g.add_argument("--decode-pp", type=int, default=1, help="pipeline-parallel size of the decode engine")
    g.add_argument(
        "--state",
        default="",
        metavar="KINDS",
        help="hybrid-model state components, comma separated: mamba,swa,nsa (state on every layer)",
    )
    g.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where engine ranks keep their KV: host memory (memfd), or VRAM (CUDA VMM; prefill ranks from "
        "cuda:0 up, decode ranks after them, wrapping around the visible devices)",
    )
    g.add_argument("--chunks", type=int, default=3, help="chunks per room (chunked prefill)")
    g.add_argument("--window", type=int, default=8, help="rooms in flight at once")
    g.add_argument("--aux-bytes", type=int, default=64, help="bytes of the aux row of each request (0: no aux)")
    g.add_argument("--seed", type=int, default=0, help="seed of the page choice")
    b = p.add_argument_group("brokers")
    b.add_argument("--prefill-broker", default=None, metavar="ADDR", help="use this running broker for prefill (its serve --listen address)")
    b.add_argument("--decode-broker", default=None, metavar="ADDR", help="use this running broker for decode")
    b.add_argument("--single-broker", action="store_true", help="one broker holds both ends of every room (one host, two GPUs)")
    b.add_argument(
        "--hosts",
        action="store_true",
        help="run each broker, and its engine ranks, on a host of its own: network namespaces on a bridge, "
        "10.77.0.1 (prefill) and 10.77.0.2 (decode), the KV bytes crossing a veth with UCX over TCP on eth0 "
        "(root and iproute2 needed; the namespaces are removed at the end)",
    )
    b.add_argument("--ucx-error-mode", choices=("peer", "none"), default="peer", help="UCX error mode of the brokers the demo starts")
    b.add_argument(
        "--staging",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="staging buffers for head-sliced transfers in the brokers the demo starts (--no-staging: per-token descriptors)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--timeout", type=float, default=120.0, help="seconds before the demo gives up")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    o.add_argument(
        "--trace",
        action="store_true",
        help="after the run, print a per-room timeline (handshake, first byte, last byte, completion on each side)",
    )
