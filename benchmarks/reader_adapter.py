"""Can a LoRA-adapted SmolLM2 read KG evidence on CPU? The base reader vs a RAFT-style adapter (issue 29).

Builds reader examples from the home's TRAIN questions (`medgraph.rl.reader`: gold facts among distractors in
the methods' layout, some with the gold withheld; no fact joining a validation or test question's concepts),
fits a LoRA adapter on the default LLM, then runs both readers on the same VALIDATION questions (never test):

    oracle-evidence   the gold facts among distractors: the reader's ceiling (the adapter must raise it)
    cot               no evidence: the adapter must NOT beat the base reader here (that would be memorising the KG)

and prints accuracy, parse failures and the share asked again, with the paired difference (bootstrap 95% CI,
sign test). Numbers go to `benchmarks/_work/reader_adapter.json`.

`--gate-check` also runs the adapted reader as the `models/reader_adapter` gate and the evaluation assets do:
batches of 24 (`reading_accuracy`), the LoRA merged into the weights (`save_policy`), and counts the replies that
differ from the unmerged, one-batch run above (when 0 of 48 differ, a gap between the gate's number and this
script's for the same examples is fit-to-fit spread, not batching or merging).

    .venv/bin/python benchmarks/reader_adapter.py --home .medgraph --valid 48
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from medgraph.rl.reader import ANSWER_FORMS, DEFAULT_LAYOUTS, DEMO_FIT, ReaderConfig, layouts_text, parse_layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(".medgraph"), help="a `make demo` home")
    parser.add_argument("--llm", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=DEMO_FIT.steps)
    parser.add_argument("--batch-size", type=int, default=DEMO_FIT.batch_size)
    parser.add_argument("--lr", type=float, default=DEMO_FIT.lr)
    parser.add_argument("--lr-schedule", default=DEMO_FIT.lr_schedule,
                        help="constant, or cosine (warm-up, then decay to lr/10)")
    parser.add_argument("--warmup-share", type=float, default=DEMO_FIT.warmup_share,
                        help="share of the steps the cosine schedule warms up")
    parser.add_argument("--lora-layers", type=int, default=None, help="adapt only the top N blocks (default: all)")
    parser.add_argument("--length-groups", type=int, default=DEMO_FIT.length_groups,
                        help="batches of like lengths, drawn this many batches at a time (0: draw order)")
    parser.add_argument("--gold-share", type=float, default=ReaderConfig.gold_share)
    parser.add_argument("--layouts", default=layouts_text(DEFAULT_LAYOUTS),
                        help="answering-call layouts of the examples and their weights (medgraph.rl.reader.LAYOUTS)")
    parser.add_argument("--one-hop-copies", type=int, default=ReaderConfig.one_hop_copies,
                        help="copies of each one-hop multiple-choice train question among the examples")
    parser.add_argument("--baited-copies", type=int, default=ReaderConfig.baited_copies,
                        help="copies (times --one-hop-copies) of each one-hop question whose answer links to a wrong "
                             "option (medgraph.rl.reader.baits_a_second_hop)")
    parser.add_argument("--no-evidence-share", type=float, default=ReaderConfig.no_evidence_share,
                        help="share of multiple-choice examples shown no evidence at all (target: nothing found)")
    parser.add_argument("--answer-form", default=ReaderConfig.answer_form, choices=ANSWER_FORMS,
                        help="how targets name the answer: its text then its letter, or its text in the tag")
    parser.add_argument("--fact-wording", default="label", choices=("label", "clause"),
                        help="a probe: show facts with their relation's label, as the KG does ('X inverse isa Y'), "
                             "or with `relation_phrases`' clause ('X has Y as a specific kind'), in training and "
                             "validation alike (patches `Triple.text` in this process only)")
    parser.add_argument("--valid", type=int, default=48, help="validation questions per dataset")
    parser.add_argument("--datasets", default="kgqa_mc", help="validation datasets (comma-separated)")
    parser.add_argument("--valid-draw", default="file", choices=("file", "qid"),
                        help="which validation questions: the first in the split's MIRAGE file "
                             "(qa/qa_items.validation.json: the evaluation's rule for its split and the gate's), "
                             "or the first by qid (the gate's rule before run 13: fewer one-hop questions)")
    parser.add_argument("--methods", default="oracle-evidence,cot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gate-check", action="store_true",
                        help="also measure the adapted reader as the asset's gate does (batches of 8, LoRA merged)")
    parser.add_argument("--champion", action="store_true",
                        help="fit nothing: measure the home's registered champion adapter (models/reader_adapter)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "_work" / "reader_adapter.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.fact_wording == "clause":
        _word_facts_as_clauses()

    from medgraph.embed.encoder import load_encoder
    from medgraph.home import HomeLayout
    from medgraph.llm import load_llm
    from medgraph.llm.models import builtin_model_dir
    from medgraph.methods.registry import make_config, run_method
    from medgraph.methods.tools import KnowledgeTools
    from medgraph.qa.table import first_as_evaluated, load_qa_items
    from medgraph.retrieval import Retriever
    from medgraph.rl.reader import baits_a_second_hop, held_out_pairs, reader_examples, train_reader_adapter
    from medgraph.stats import paired_difference
    from medgraph.storage import Lake, Warehouse

    warehouse = Warehouse(args.home / "warehouse.duckdb", Lake(args.home / "lake"))
    layouts = parse_layouts(args.layouts)
    config = ReaderConfig(gold_share=args.gold_share, layouts=layouts, no_evidence_share=args.no_evidence_share,
                          one_hop_copies=args.one_hop_copies, baited_copies=args.baited_copies,
                          answer_form=args.answer_form, seed=args.seed)
    config = replace(config, fit=replace(config.fit, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                         lr_schedule=args.lr_schedule, warmup_share=args.warmup_share,
                                         lora_layers=args.lora_layers, length_groups=args.length_groups,
                                         seed=args.seed, progress=True))
    train, validation = load_qa_items(warehouse, "train"), load_qa_items(warehouse, "validation")
    held_out = held_out_pairs([*validation, *load_qa_items(warehouse, "test")])
    datasets = args.datasets.split(",")
    if args.valid_draw == "file":
        valid = first_as_evaluated(validation, HomeLayout(args.home).qa_split("validation"), datasets, args.valid)
    else:
        valid = [item for dataset in datasets for item in [i for i in validation if i.dataset == dataset][: args.valid]]

    with Retriever(warehouse, load_encoder("minilm")) as retriever:
        tools = KnowledgeTools(retriever)
        base = load_llm(args.llm, home=args.home)
        examples, counts = reader_examples(retriever.graph, train, config, held_out, count_tokens=base.count_tokens,
                                           tools=tools)
        print(f"{len(examples)} reader examples from {len(train)} train questions: {dict(counts)}", flush=True)
        for layout in dict.fromkeys(e.layout for e in examples):
            example = next(e for e in examples if e.layout == layout)
            print(f"e.g. ({layout})", example.conversation[-2].content[-500:], "\n->", example.conversation[-1].content,
                  flush=True)
        started = time.perf_counter()
        if args.champion:
            adapted_reader, metrics = _champion(args.home)
        else:
            fitted = train_reader_adapter(builtin_model_dir(args.llm, args.home), examples, config, held_out,
                                          name=f"{args.llm}+reader")
            adapted_reader, metrics = fitted.policy, fitted.metrics
        print(f"adapter: {metrics}", flush=True)

        rows, results = {}, {}
        options = {item.qid: item.options for item in valid}
        # One-hop questions whose answer links to a wrong option count apart: the reader chains past them (run 14).
        shape = {item.qid: "1 baited" if baited else str(item.extra.get("hops"))
                 for item, baited in zip(valid, baits_a_second_hop(retriever.graph, valid), strict=True)}
        for method in args.methods.split(","):
            for reader_name, reader in (("base", base), ("adapted", adapted_reader)):
                t0 = time.perf_counter()
                results[method, reader_name] = run_method(method, valid, tools, reader, make_config(method),
                                                          batch_size=len(valid))
                print(f"  {method} / {reader_name}: {time.perf_counter() - t0:.0f} s", flush=True)
            by_reader = {r: {x.qid: x for x in results[method, r]} for r in ("base", "adapted")}
            qids = sorted(by_reader["base"])
            diff = paired_difference([float(by_reader["adapted"][q].correct) for q in qids],
                                     [float(by_reader["base"][q].correct) for q in qids])
            rows[method] = {
                "n": len(qids), "paired_accuracy": asdict(diff),
                **{f"{r}_{k}": sum(getattr(x, f) for x in results[method, r]) / len(qids)
                   for r in ("base", "adapted") for k, f in (("parse_failures", "parse_failed"),
                                                             ("asked_again", "extra_answer_call"))},
                **{f"{r}_correct_by_shape": {h: f"{sum(x.correct for x in results[method, r] if shape[x.qid] == h)}/"
                                                f"{sum(1 for q in qids if shape[q] == h)}"
                                             for h in sorted(set(shape.values()))}
                   for r in ("base", "adapted")},
                **{f"{r}_correct_when_gold_shown": _correct_when_gold_shown(results[method, r])
                   for r in ("base", "adapted")},
                **{f"{r}_answers": dict(sorted(_counts(x.prediction for x in results[method, r]).items()))
                   for r in ("base", "adapted")},
                **{f"{r}_misses": dict(sorted(_counts(
                    miss_kind(options[x.qid], x.answer, " ".join(s.output for s in x.steps if s.output))
                    for x in results[method, r] if not x.correct).items())) for r in ("base", "adapted")},
                # What each reader wrote, to read why it chose (the first answer call and any extra one).
                "replies": [{"qid": q, "gold": by_reader["base"][q].answer,
                             **{r: [s.output for s in by_reader[r][q].steps if s.output] for r in ("base", "adapted")}}
                            for q in qids],
            }
        gate = gate_check(adapted_reader, valid, tools, results, args.methods.split(",")) if args.gate_check else None
    summary = {"config": config.as_dict(), "examples": dict(counts), "adapter": metrics,
               "valid_datasets": datasets, "methods": rows, "gate_check": gate,
               "seconds": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, default=str))

    print(f"\n{'method':<16} {'n':>3} {'base':>6} {'adapted':>7} {'diff':>7}  95% CI            better/worse  p      "
          f"parse fail b/a   asked again b/a")
    for method, row in rows.items():
        d = row["paired_accuracy"]
        print(f"{method:<16} {row['n']:>3} {d['mean_b']:>6.3f} {d['mean_a']:>7.3f} {d['difference']:>+7.3f}  "
              f"[{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]  {d['a_better']:>3}/{d['b_better']:<3}   {d['p_value']:.3f}  "
              f"{row['base_parse_failures']:.2f}/{row['adapted_parse_failures']:.2f}       "
              f"{row['base_asked_again']:.2f}/{row['adapted_asked_again']:.2f}")
        print(f"{'':<16} correct by shape base {row['base_correct_by_shape']}  "
              f"adapted {row['adapted_correct_by_shape']}")
        print(f"{'':<16} correct when every gold fact was shown base {row['base_correct_when_gold_shown']}  "
              f"adapted {row['adapted_correct_when_gold_shown']}")
        print(f"{'':<16} answers base {row['base_answers']}  adapted {row['adapted_answers']}")
        print(f"{'':<16} misses base {row['base_misses']}  adapted {row['adapted_misses']}")


def _word_facts_as_clauses() -> None:
    """Every fact shown in this process reads "<subject> <clause>" (`relation_phrases(relation).clause`)."""
    from medgraph.kg.graph import Triple
    from medgraph.kg.relation_phrases import relation_phrases

    Triple.text = property(lambda t: f"{t.src_name} {relation_phrases(t.relation).clause.format(object=t.dst_name)}")


def _champion(home: Path) -> tuple[object, dict[str, object]]:
    """The home's `medgraph-reader-adapter@champion` (what the evaluation's `@adapted` rows answer with)."""
    from medgraph.eval.readers import load_adapted_reader
    from medgraph.settings import load_settings
    from medgraph.tracking import Tracking

    reader, uri = load_adapted_reader(Tracking.from_settings(load_settings({"MEDGRAPH_HOME": str(home)})))
    if reader is None:
        raise SystemExit(f"--champion: {uri}")
    return reader, {"champion": uri}


def gate_check(reader, valid, tools, results, methods) -> dict[str, dict[str, object]]:
    """The adapted reader's accuracy in batches of 8 (unmerged), then merged in batches of 8 and of all, and
    per variant the questions whose replies differ from the one-batch unmerged run."""
    import tempfile

    from medgraph.methods.registry import make_config, run_method
    from medgraph.rl.model import save_policy

    def replies(run) -> dict[str, list[str]]:
        return {r.qid: [s.output for s in r.steps if s.output] for r in run}

    def measured(label: str, batch_size: int) -> None:
        for method in methods:
            run = run_method(method, valid, tools, reader, make_config(method), batch_size=batch_size)
            same = replies(results[method, "adapted"])
            check[f"{method} {label}"] = {
                "accuracy": sum(r.correct for r in run) / len(run),
                "replies_differ": sum(replies(run)[q] != same[q] for q in same)}
            print(f"  gate check {method} {label}: {check[f'{method} {label}']}", flush=True)

    check: dict[str, dict[str, object]] = {}
    measured("unmerged, batch 8", 8)
    with tempfile.TemporaryDirectory() as out:
        save_policy(reader, Path(out) / "reader")  # merges the LoRA into the weights, as the asset does
    reader.clear_prefix_cache()
    measured("merged, batch 8", 8)
    measured(f"merged, batch {len(valid)}", len(valid))
    return check


def miss_kind(options: dict[str, str], gold: str, reply: str) -> str:
    """Why a wrong answer was wrong, read from the reply's last "answer is ..." (else all of it): it names the
    gold option's text alone and then another letter (`letter`: the look-up from text to letter failed), names
    a wrong option (`wrong_option`: it read the wrong fact), several options with the gold (`several`), or none
    (`no_option`)."""
    named_part = reply.lower().rsplit("answer is", 1)[-1]
    named = {letter for letter, text in options.items() if text.lower() in named_part}
    if named == {gold}:
        return "letter"
    return "several" if gold in named else "wrong_option" if named else "no_option"


def _correct_when_gold_shown(results) -> str:
    """Reading apart from retrieval: "right/asked" over the questions whose gold facts were all in the evidence
    (`gold_fact_seen`, which `run_method` sets as the evaluation does)."""
    shown = [result for result in results if result.gold_fact_seen == 1]
    return f"{sum(result.correct for result in shown)}/{len(shown)}"


def _counts(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


if __name__ == "__main__":
    main()
