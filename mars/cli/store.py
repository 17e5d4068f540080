"""``mars store ls | configure-dvc``: params ``store`` (+ ``--store``) -> :mod:`mars.release.store`."""

from __future__ import annotations

import argparse

from mars.cli.options import add_params_arguments, add_store_argument, params_from_args, store_config


def main(argv: list[str], verb: str = "store") -> int:
    from mars.release.promote import list_releases
    from mars.release.store import configure_dvc, open_store

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description="Inspect the artifact store; wire DVC to it.")
    sub = parser.add_subparsers(dest="command", required=True)
    conf = sub.add_parser("configure-dvc", help="point a DVC remote at <store>/dvc (dvc push/pull share the store)")
    conf.add_argument("--repo", default=".", help="the DVC repository (default: .)")
    conf.add_argument("--remote", help="remote name (default: store.dvc_remote)")
    conf.add_argument("--no-default", action="store_true", help="do not make it the default remote")
    ls = sub.add_parser("ls", help="list releases and stage pointers")
    ls.add_argument("name", nargs="?", help="release name (default: all)")
    ls.add_argument("--all", action="store_true",
                    help="also list incomplete releases (a promote killed before its seal; pull refuses them)")
    for p in (conf, ls):
        add_params_arguments(p)
        add_store_argument(p)
    args = parser.parse_args(argv)
    cfg = store_config(params_from_args(args), args.store)
    if args.command == "configure-dvc":
        url = configure_dvc(cfg, args.repo, args.remote, default=not args.no_default)
        print(f"dvc remote {args.remote or cfg.dvc_remote} -> {url}")
        return 0
    store = open_store(cfg)
    store.check()
    for line in list_releases(store, args.name, incomplete=args.all):
        print(line)
    return 0
