"""Training loops: functions of one argument, the loop context (shardline.LoopContext)."""

import time

import torch
import torch.nn.functional as F

from .nets import Classifier, Planless


def alternating_step(encoder, head, opt_e, opt_h, x, y, step: int) -> float:
    """One step of two models and two optimizers: even steps update the encoder, odd ones the
    head. The rows are shuffled within the batch from torch's generator: the mean loss is
    the same, its rounding is not, so an exact resume needs every rank's RNG back."""
    perm = torch.randperm(len(y))
    loss = F.cross_entropy(head(encoder(x[perm])), y[perm])
    opt_e.zero_grad()
    opt_h.zero_grad()
    loss.backward()
    (opt_e if step % 2 == 0 else opt_h).step()
    return loss.item()


def build(ctx) -> Classifier:
    torch.manual_seed(ctx.config.seed)  # every rank the same weights
    return Classifier(ctx.inputs.feature_width, ctx.args["width"], ctx.inputs.output_width)


def two_models(ctx):
    """The encoder and the head prepared each with its own optimizer, alternating steps,
    checkpoints every `save_every` steps, figures logged on every rank; the classifier (or
    with `register = "encoder"`, the encoder alone: its output is an embedding) registered,
    and a line on the driver's console."""
    a = ctx.args
    model = build(ctx)
    encoder, opt_e = ctx.prepare(model.encoder, lambda p: torch.optim.Adam(p, lr=a["lr"]))
    head, opt_h = ctx.prepare(model.head, lambda p: torch.optim.SGD(p, lr=a["lr"], momentum=0.9))
    loader = ctx.loader("train")
    state = {"models": {"encoder": encoder, "head": head}, "optimizers": [opt_e, opt_h], "loader": loader,
             "progress": {"losses": []}}
    step = ctx.restore(state) or 0
    while loader.current_epoch < a["epochs"]:
        for x, y in loader:
            loss = alternating_step(encoder, head, opt_e, opt_h, ctx.to_device(x), ctx.to_device(y), step)
            step += 1
            state["progress"]["losses"] = [*state["progress"]["losses"][-2:], loss]
            if step % a["save_every"] == 0:
                ctx.save(state, step=step)
            time.sleep(a.get("pause_s", 0.0))  # a kill test's room to land after a checkpoint
        ctx.log({"loss": loss, "epoch_steps": len(loader)}, step=step)
        if ctx.rank == 0:
            ctx.say(f"epoch {loader.current_epoch} done: loss {loss:.3f}")
    if a.get("register") == "encoder":  # its input by a name of its own, `x`; its output an embedding
        ctx.register(model.encoder, example={"x": x[:4]},
                     args={"features": ctx.inputs.feature_width, "width": a["width"]})
    elif a.get("register", "classifier") == "classifier":
        ctx.register(model, example=x[:4], args={"features": ctx.inputs.feature_width, "width": a["width"],
                                                 "classes": ctx.inputs.output_width})


def raises(ctx):
    """A bug in the user's loop, on every rank."""
    raise ValueError("boom: this loop fails")


def reads_a_missing_split(ctx):
    for _ in ctx.loader("holdout"):
        pass


def prepares_a_planless_model(ctx):
    ctx.prepare(Planless(ctx.inputs.feature_width, ctx.inputs.output_width))


def takes_two(ctx, extra):
    """Not a loop: it takes two arguments."""
