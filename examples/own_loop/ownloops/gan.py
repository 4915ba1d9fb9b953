"""A conditional GAN on the digit images: two models, two optimizers, alternating steps.

`train_gan(ctx)` is the loop (`training.loop = "ownloops.gan:train_gan"`); its settings are
`[training.loop_args]`: latent, width, lr, epochs, save_every. The registered model is the
generator: noise `z` and a `digit` in, a [1, 16, 16] image in [-1, 1] out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIGITS, SIZE = 10, 16


class Generator(nn.Module):
    """z [batch, latent] float32 and digit [batch] int64 -> images [batch, 1, SIZE, SIZE] in [-1, 1]."""

    def __init__(self, latent: int = 16, width: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(latent + DIGITS, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, SIZE * SIZE), nn.Tanh(),
        )

    def forward(self, z: torch.Tensor, digit: torch.Tensor) -> torch.Tensor:
        h = torch.cat([z, F.one_hot(digit.long(), DIGITS).to(z.dtype)], dim=1)
        return self.net(h).view(-1, 1, SIZE, SIZE)


class Discriminator(nn.Module):
    """images [batch, 1, SIZE, SIZE] in [-1, 1] and their digits -> one logit each: real or not."""

    def __init__(self, width: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(SIZE * SIZE + DIGITS, width), nn.LeakyReLU(0.2),
            nn.Linear(width, 1),
        )

    def forward(self, image: torch.Tensor, digit: torch.Tensor) -> torch.Tensor:
        h = torch.cat([image.flatten(1), F.one_hot(digit.long(), DIGITS).to(image.dtype)], dim=1)
        return self.net(h).squeeze(1)


def train_gan(ctx):
    a = ctx.args
    adam = lambda params: torch.optim.Adam(params, lr=a["lr"], betas=(0.5, 0.999))  # noqa: E731
    torch.manual_seed(ctx.config.seed)  # every rank starts from the same weights
    generator, discriminator = Generator(a["latent"], a["width"]), Discriminator(a["width"])
    gen, opt_g = ctx.prepare(generator, adam)  # the job's strategy (ddp): each model its own wrapper
    disc, opt_d = ctx.prepare(discriminator, adam)
    loader = ctx.loader("train")  # this rank's shards: {"image": uint8 [b, 1, 16, 16], "label": int64 [b]}
    state = {"generator": gen, "discriminator": disc, "opt_g": opt_g, "opt_d": opt_d, "loader": loader}
    step = ctx.restore(state) or 0  # after a lost rank: the last checkpoint, mid-epoch included
    losses = {}  # the last step's: a restore at an epoch's end leaves that epoch no batch to take
    while loader.current_epoch < a["epochs"]:
        for batch in loader:
            real = ctx.to_device(batch["image"]).float() / 127.5 - 1
            digit = ctx.to_device(batch["label"])
            n = len(digit)
            z = torch.randn(n, a["latent"], device=ctx.device)  # each rank's generator state is checkpointed
            fake = gen(z, digit)
            # The discriminator's step: real and generated images in one forward (one DDP
            # forward per backward), the generator's output detached.
            logits = disc(torch.cat([real, fake.detach()]), torch.cat([digit, digit]))
            loss_d = F.binary_cross_entropy_with_logits(logits, torch.cat([torch.ones(n), torch.zeros(n)]).to(logits))
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            # The generator's step: make the discriminator call its images real.
            loss_g = F.binary_cross_entropy_with_logits(disc(fake, digit), torch.ones(n, device=ctx.device))
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            losses = {"loss_d": loss_d.item(), "loss_g": loss_g.item()}
            step += 1
            if step % a["save_every"] == 0:
                ctx.save(state, step=step)
        if losses:
            ctx.log(losses, step=step)
    # The generator alone, rebuilt as Generator(latent, width): its inputs are its own, a noise
    # vector `z` and a `digit` (an example batch of them gives their dtypes and shapes).
    example = {"z": torch.zeros(4, a["latent"]), "digit": torch.arange(4)}
    ctx.register(generator, example=example, args={"latent": a["latent"], "width": a["width"]})
