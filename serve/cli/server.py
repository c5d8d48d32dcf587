"""`manyfold serve` and `manyfold demo`: serve a store over HTTP, the demo's store built first if need be."""

import argparse
import sys
from pathlib import Path

from serve.cli.args import add_command
from serve.cli.store import cmd_store_list
from serve.errors import ConfigError


def cmd_demo(args: argparse.Namespace) -> None:
    from serve.demo import build_demo_store, demo_store_dir

    root = Path(args.store) if args.store else demo_store_dir()
    build_demo_store(root, log=lambda m: print(m, file=sys.stderr))
    print(f"demo store: {root}")
    cmd_store_list(argparse.Namespace(store=root, json=False))
    if args.no_serve:
        return
    from serve.app import run_server

    config = _serve_config(args, str(root))
    run_server(config, ready=lambda url: _print_examples(url, config))


def cmd_serve(args: argparse.Namespace) -> None:
    from serve.app import run_server

    config = _serve_config(args, args.store)
    run_server(config, ready=lambda url: _print_examples(url, config))


def _serve_config(args: argparse.Namespace, store: str | None):
    """store as given: a local path or an object-storage URL (a pathlib.Path would fold s3:// into s3:/);
    ServeConfig tells them apart."""
    from serve.config import load_config, parse_config

    address = getattr(args, "ray_address", None)
    if getattr(args, "config", None):
        config = load_config(args.config, store=store, port=args.port)
        return config.model_copy(update={"ray_address": address}) if address else config
    if store is None:
        raise ConfigError("serve needs --store DIR or --config FILE")
    return parse_config({"store": store, "port": args.port or 8000, "ray_address": address})


def _print_examples(url: str, config) -> None:
    from serve.store.model_dir import is_causal_lm
    from serve.store.store import open_store

    store = open_store(config.store)
    lines = [f"serving {config.store} at {url}  (Ctrl-C to stop)", "", "try:"]
    classifiers = [m for v in store.manifest.variants.values() for m, labels in v.models().items() if labels]
    if classifiers:
        lines.append(f"  curl -s {url}/v1/classify -H 'Content-Type: application/json' "
                     f"-d '{{\"model\": \"{classifiers[0]}\", \"input\": \"a short text to classify\"}}'")
    for b in store.manifest.bases.values():
        if is_causal_lm(b.architecture):
            lines.append(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
                         f"-d '{{\"model\": \"{b.name}\", \"messages\": [{{\"role\": \"user\", "
                         f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
        elif b.architecture == "BertModel":
            lines.append(f"  curl -s {url}/v1/embeddings -H 'Content-Type: application/json' "
                         f"-d '{{\"model\": \"{b.name}\", \"input\": \"hello\"}}'")
    lines += [f"  curl -s {url}/v1/models", f"  curl -s {url}/metrics", "",
              f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); "
              f"print([m.id for m in c.models.list()])\""]
    print("\n".join(lines), flush=True)


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    demo = add_command(sub, "demo", cmd_demo, "build the demo store (cached) and show what it holds")
    demo.add_argument("--store", help="where to build it (default: $MANYFOLD_HOME/demo-store)")
    demo.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1")
    demo.add_argument("--no-serve", action="store_true", help="build the store and stop")


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    srv = add_command(sub, "serve", cmd_serve, "serve a store over HTTP on Ray Serve (127.0.0.1 by default)")
    srv.add_argument("--store", help="the store (or `store:` in --config)")
    srv.add_argument("--config", help="ServeConfig as YAML or JSON (see deploy/serve-config.yaml)")
    srv.add_argument("--port", type=int, default=None)
    srv.add_argument("--ray-address", help="deploy onto this running Ray cluster (ray://HOST:10001, HOST:6379 or "
                                           "auto) instead of starting Ray here")
