"""`pyscore` command line: a client of a running pyscore server (`pyscore-server`, or `python -m server` in a checkout).

    pyscore score --query "Where is my order?" --item "Track the order" --item "Refund" --labels Yes No
    pyscore generate "Once upon a time" --max-tokens 20 --stream
    pyscore info
    pyscore tokenize "Hello world"

Prints readable tables, or the result as JSON with --json. gRPC errors print `error: CODE: message` on stderr
and exit 1. A secured server: `--tls-ca ca.pem` (plus `--tls-cert/--tls-key` for mTLS) and the token in
$PYSCORE_AUTH_TOKEN (or `--auth-token`, which other users can see in the process list).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc

from pyscore import __version__
from pyscore.client import DEFAULT_TARGET, ScorerClient
from pyscore.types import GenerateResult, ModelInfo, ScoreResult, TokenLogprob, Usage


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=DEFAULT_TARGET,
                        help="server address HOST:PORT, or several replicas: ipv4:HOST:PORT,HOST:PORT or "
                             "dns:///NAME:PORT (round_robin over the SERVING ones, UNAVAILABLE retried on another; "
                             "default %(default)s)")
    common.add_argument("--prefix-affinity", type=int, default=None, metavar="N",
                        help="send x-pyscore-prefix, a hash of the query's first N characters, for a gateway that "
                             "routes equal prefixes to one replica (deploy/envoy)")
    common.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    common.add_argument("--model", default="", help="model name to check against the served one (default: any)")
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    common.add_argument("--tls-ca", help="PEM CA certificate to trust: connect with TLS")
    common.add_argument("--tls-cert", help="PEM client certificate (mTLS; with --tls-key)")
    common.add_argument("--tls-key", help="PEM private key of --tls-cert")
    common.add_argument("--auth-token", default=os.environ.get("PYSCORE_AUTH_TOKEN"),
                        help="bearer token (default: $PYSCORE_AUTH_TOKEN)")

    p = argparse.ArgumentParser(prog="pyscore", description="Client of a pyscore.v1.Scorer server.")
    p.add_argument("--version", action="version", version=f"pyscore {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("score", parents=[common], help="score items against a query by label probabilities")
    q = s.add_mutually_exclusive_group(required=True)
    q.add_argument("--query", help="query text")
    q.add_argument("--query-ids", type=_ids, help='query token ids, e.g. "1 2 3"')
    s.add_argument("--item", action="append", default=[], help="an item's text (repeat per item)")
    s.add_argument("--item-ids", type=_ids, action="append", default=[], help="an item's token ids (repeat)")
    s.add_argument("--labels", nargs="+", help="label strings, each a single token (e.g. Yes No)")
    s.add_argument("--label-ids", type=int, nargs="+", help="label token ids")
    s.add_argument("--apply-softmax", action="store_true", help="softmax over the labels only (rows sum to 1)")
    s.add_argument("--item-first", action="store_true", help="put each item before the query")
    s.add_argument("--score-extraction-token", help="setwise: read a row at every occurrence of this token")
    s.add_argument("--mode", choices=["auto", "sis", "mis"], default="auto", help="execution mode (default auto)")
    s.add_argument("--bypass-prefix-cache", action="store_true",
                   help="neither read nor write the server's prefix cache (cold timings)")

    g = sub.add_parser("generate", parents=[common], help="generate a completion")
    g.add_argument("prompt", nargs="?", help="prompt text")
    g.add_argument("--prompt-ids", type=_ids, help="prompt token ids instead of text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--top-logprobs", type=int, default=0, help="print this many alternatives per token")
    g.add_argument("--prompt-logprobs", type=int, default=None,
                   help="also print every prompt token's logprob, with this many alternatives each")
    g.add_argument("--prompt-logprobs-start", type=int, default=0,
                   help="with --prompt-logprobs: from this prompt token on (the context before may be cached)")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument("--bypass-prefix-cache", action="store_true",
                   help="neither read nor write the server's prefix cache (prefill the whole prompt)")

    sub.add_parser("info", parents=[common], help="describe the served model")

    t = sub.add_parser("tokenize", parents=[common], help="tokenize text with the served model's tokenizer")
    t.add_argument("text")
    t.add_argument("--no-special-tokens", action="store_true", help="do not add BOS etc.")
    return p


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [header, *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def _clip(text: str, width: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def format_score(result: ScoreResult, items: Sequence[str], labels: Sequence[str] | None) -> str:
    names = [label.strip() or repr(label) for label in labels] if labels else [str(i) for i in result.label_token_ids]
    rows = []
    for i, item_rows in enumerate(result.scores):
        for j, row in enumerate(item_rows):
            number = f"{i + 1}" if len(item_rows) == 1 else f"{i + 1}.{j + 1}"
            rows.append([number, _clip(items[i]) if j == 0 else "", *(f"{v:.4f}" for v in row)])
    u = result.usage
    label_ids = " ".join(f"{n}={i}" for n, i in zip(names, result.label_token_ids, strict=False))
    head = f"mode {result.mode}  labels {label_ids}  {_tokens(u)}  {_server_time(u)}"
    return head + "\n" + _table(["#", "item", *names], rows)


def _tokens(u: Usage) -> str:
    cached = f" / {u.cached_tokens} cached" if u.cached_tokens else ""
    return f"tokens {u.prompt_tokens} prompt / {u.computed_tokens} computed{cached}"


def _server_time(u: Usage) -> str:
    return f"server {u.queue_s * 1e3:.1f} ms queued / {u.compute_s * 1e3:.1f} ms computing"


def _logprob_table(logprobs: Sequence[TokenLogprob]) -> str:
    rows = [[repr(lp.token), str(lp.token_id), f"{lp.logprob:.4f}",
             ", ".join(f"{t.token!r} {t.logprob:.3f}" for t in lp.top)] for lp in logprobs]
    return _table(["token", "id", "logprob", "top"], rows)


def format_generate(result: GenerateResult, show_logprobs: bool) -> str:
    u = result.usage
    out = [result.text, f"[finish {result.finish_reason}  {_tokens(u)}  {_server_time(u)}]"]
    if show_logprobs:
        out.append(_logprob_table(result.logprobs))
    if result.prompt_logprobs is not None:
        out += ["prompt (the first token has nothing before it):", _logprob_table(result.prompt_logprobs)]
    return "\n".join(out)


def format_info(info: ModelInfo) -> str:
    rows = [[f.name, str(getattr(info, f.name))] for f in dataclasses.fields(info)
            if f.name not in ("special_tokens", "memory")]
    rows += [[f"special_tokens.{k}", repr(v)] for k, v in sorted(info.special_tokens.items())]
    if info.memory is not None:
        sizes = {**dataclasses.asdict(info.memory), "expected_total_bytes": info.memory.expected_total_bytes}
        rows += [[f"memory.{k}", f"{v} ({v / 2**30:.2f} GiB)" if k != "kv_bytes_per_token" else str(v)]
                 for k, v in sizes.items()]
    return _table(["field", "value"], rows)


def _json(obj: Any) -> str:
    return json.dumps(dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj, indent=2)


def run(args: argparse.Namespace, client: ScorerClient) -> None:
    if args.command == "score":
        query = args.query if args.query is not None else args.query_ids
        items: list[Any] = args.item_ids if args.item_ids else args.item
        result = client.score(query, items, model=args.model, labels=args.labels, label_token_ids=args.label_ids,
                              apply_softmax=args.apply_softmax, item_first=args.item_first,
                              score_extraction_token=args.score_extraction_token, mode=args.mode,
                              bypass_prefix_cache=args.bypass_prefix_cache)
        shown = [str(i) if not isinstance(i, str) else i for i in items]
        print(_json(result) if args.json else format_score(result, shown, args.labels))
    elif args.command == "generate":
        prompt = args.prompt_ids if args.prompt_ids is not None else (args.prompt or "")
        options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       seed=args.seed, stop=args.stop, top_logprobs=args.top_logprobs, apply_chat_template=args.chat,
                       bypass_prefix_cache=args.bypass_prefix_cache, prompt_logprobs=args.prompt_logprobs,
                       prompt_logprobs_start=args.prompt_logprobs_start)
        if args.stream and not args.json:
            for chunk in client.generate_stream(prompt, model=args.model, **options):
                print(chunk.text, end="", flush=True)
                if chunk.usage is not None:
                    u = chunk.usage
                    print(f"\n[finish {chunk.finish_reason}  {_tokens(u)}  {_server_time(u)}]")
            return
        result = client.generate(prompt, model=args.model, **options)
        print(_json(result) if args.json else format_generate(result, args.top_logprobs > 0))
    elif args.command == "info":
        info = client.model_info()
        print(_json(info) if args.json else format_info(info))
    elif args.command == "tokenize":
        ids, tokens = client.tokenize(args.text, add_special_tokens=not args.no_special_tokens)
        if args.json:
            print(_json({"token_ids": ids, "tokens": tokens}))
        else:
            rows = [[str(i), str(t), repr(s)] for i, (t, s) in enumerate(zip(ids, tokens, strict=True))]
            print(_table(["#", "id", "token"], rows))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with ScorerClient(args.target, timeout=args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                          tls_key=args.tls_key, auth_token=args.auth_token,
                          prefix_affinity=args.prefix_affinity) as client:
            run(args, client)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
