"""`rayload compress` and `rayload retrain`: the model lifecycle after training."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.markup import escape

from .cli import AddressOpt, SetOpt, _friendly, _g, app, console, err_console


@app.command()
@_friendly
def compress(
    checkpoint: Annotated[str, typer.Argument(help="checkpoint directory (rayload train's output)")],
    method: Annotated[str, typer.Option(help="int8 (dynamic int8 linear layers, int8 embedding tables) or prune")] = "int8",
    amount: Annotated[Optional[float], typer.Option(help="prune: fraction of linear weights (or neurons, with --structured) to cut "
                                                          "[default: 0.5]")] = None,
    structured: Annotated[bool, typer.Option(help="prune whole output neurons instead of single weights")] = False,
    finetune_epochs: Annotated[int, typer.Option(help="prune: epochs of fine-tuning with the cut weights held at zero")] = 0,
    max_auc_drop: Annotated[float, typer.Option(help="refuse when the validation AUC drops by more than this")] = 0.002,
    out: Annotated[Optional[str], typer.Option(help="output checkpoint, a folder or a URI (default beside it, on its storage: CHECKPOINT-int8, "
                                                    "CHECKPOINT-pruneNN, CHECKPOINT-pruneNN-structured, NN the exact percentage: prune50, prune50.4)")] = None,
    spec: Annotated[Optional[str], typer.Option(help="the job spec it was trained with (default: the one in its manifest; --set applies to either)")] = None,
    set_: SetOpt = None, address: AddressOpt = None,
) -> None:
    """Write a compressed copy of a checkpoint if it passes the validation-AUC gate."""
    from .compression import GateRefused
    from .compression import compress as run
    from .spec import load_spec

    job = load_spec(spec, set_ or []) if spec else None
    with console.status(f"{method}: compressing and scoring the validation split..."):
        try:
            result = run(checkpoint, method, amount=amount, structured=structured, finetune_epochs=finetune_epochs,
                         max_auc_drop=max_auc_drop, out=out, spec=job, address=address, overrides=[] if spec else (set_ or []))
        except GateRefused as exc:
            err_console.print(f"[bold red]{escape(str(exc))}[/]", highlight=False)  # it says "... model refused: ..." itself
            raise typer.Exit(1) from None
    console.print(f"[green]wrote[/] {escape(result.checkpoint)}")
    size = (f"{result.bytes_before / max(result.bytes_after, 1):.2f}x smaller" if result.method == "int8" else
            "zeros are stored as dense weights: the file is the same size; the sparsity below is what pruning bought")
    console.print(f"validation AUC {result.auc_before:.5f} -> {result.auc_after:.5f} (drop {result.auc_drop:+.5f}, "
                  f"allowed {result.max_auc_drop}); model.pt {result.bytes_before:,} -> {result.bytes_after:,} bytes ({size})")
    if "sparsity" in result.settings:
        console.print(f"sparsity of the linear weights {result.settings['sparsity']:.1%}")


@app.command()
@_friendly
def retrain(
    spec: Annotated[str, typer.Argument(help="job spec whose training settings the retrain uses")],
    from_events: Annotated[str, typer.Option("--from-events", help="the A/B run whose logged feedback to learn from")],
    window: Annotated[str, typer.Option(help="recent events to use: 30m, 12h, 7d, 2w or all")] = "7d",
    attribution: Annotated[Optional[str], typer.Option(help="an outcome within this long after the exposure makes it a positive "
                                                              "(default: the experiment's analysis.attribution_s, else 30m)")] = None,
    min_auc_gain: Annotated[float, typer.Option(help="the new model must beat the champion's AUC by this on held-out events")] = 0.0,
    weight: Annotated[Optional[float], typer.Option(help="challenger weight in the next experiment (default: the ramp's first step, else the "
                                                          "prior challenger's weight; a shadow experiment stays in shadow mode at weight 0 "
                                                          "unless --weight > 0 is given)")] = None,
    name: Annotated[Optional[str], typer.Option(help="name of the next experiment (default: the experiment's, with its -rYYYYMMDD-HHMMSS "
                                                      "retrain stamp replaced by this retrain's)")] = None,
    set_: SetOpt = None, address: AddressOpt = None,
) -> None:
    """Retrain the champion on its A/B feedback, gate it offline, and register it as the next challenger."""
    from .retraining import retrain as run

    with console.status("joining exposures and outcomes, warm-starting from the champion..."):
        result = run(spec, from_events, window=window, attribution=attribution, min_auc_gain=min_auc_gain,
                     challenger_weight=weight, name=name, overrides=set_ or [], address=address)
    console.print(f"{result.rows:,} labelled exposures ({result.positives:,} positive) from experiment {result.experiment}")
    console.print(f"held-out AUC ({result.gate_split} split of the event rows, {result.gate_rows} rows, {result.gate_positives} positive): "
                  f"champion {_g(result.auc_champion)}, retrained {_g(result.auc_new)} (needs a gain of {result.min_auc_gain}); "
                  f"gain {result.auc_new - result.auc_champion:+.4f}, 95% interval [{result.gain_ci[0]:+.4f}, {result.gain_ci[1]:+.4f}], "
                  f"p={result.gain_p:.3g} (DeLong, paired); checkpoint {escape(result.checkpoint)}")
    if result.warm_start and result.warm_start != result.champion:
        console.print(f"warm-started from {escape(result.warm_start)} (the compressed champion's original)")
    if not result.passed:
        err_console.print("[bold red]refused:[/] the retrained model does not beat the champion on recent events; no experiment written")
        raise typer.Exit(1)
    console.print(f"[green]next experiment:[/] rayload serve {escape(result.ab_spec)}")
