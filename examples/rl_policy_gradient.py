"""A GRPO-style policy-gradient step with ``mst_jax.linear_log_probs``.

The toy task: from a random first token, write ``--length`` more tokens, each
the previous one plus ``--step`` (mod the vocabulary). A sequence's reward is
the fraction of its tokens that follow the rule. The policy is a tiny Flax NNX
model (an embedding of the previous token, one hidden layer, and an
``mst_jax.LMHeadLoss`` head).

Each iteration samples ``--group`` completions per prompt from the current
policy, normalises their rewards within each group (the advantage), and takes
``--epochs`` optimizer steps on the clipped surrogate objective
(``mst_jax.losses.policy_gradient_loss``, reduced by ``--loss-type``) with an
entropy bonus (the entropy's mean over the completions' tokens). The
per-token log-probabilities and entropies come from the head's ``log_probs``
(``mst_jax.linear_log_probs``), which never forms the ``[tokens, V]`` logits;
sampling uses ``logits`` for the one position it draws.

With the defaults the reward rises from chance (1/64) to about 0.75: the
policy learns the rule along a cycle of tokens it keeps sampling, and, its
entropy spent, rarely leaves it (once a group's completions agree, their
advantages are 0). The last line is the verdict: whether the reward rose
(exit status 1 if not).

It needs the examples extra (``pip install -e ".[examples]"``, for optax); the
defaults take about 8 seconds on a two-core CPU.

  pip install -e ".[examples]"
  python examples/rl_policy_gradient.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mst_jax


class Policy(nnx.Module):
  """Next-token distribution from the previous token alone."""

  def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.mix = nnx.Linear(dim, dim, rngs=rngs)
    self.head = mst_jax.nnx.LMHeadLoss(dim, vocab, rngs=rngs)

  def hidden(self, previous: jax.Array) -> jax.Array:
    return jnp.tanh(self.mix(self.embed(previous)))


@nnx.jit(static_argnames=("length",))
def sample(policy: Policy, key: jax.Array, first: jax.Array, length: int):
  """``(previous, tokens)``, each ``[B, length]``: tokens drawn one at a time."""

  def draw(previous, key):
    logits = policy.head.logits(policy.hidden(previous))  # [B, V]: one position
    token = jax.random.categorical(key, logits)
    return token, (previous, token)

  _, (previous, tokens) = jax.lax.scan(draw, first, jax.random.split(key, length))
  return previous.T, tokens.T


def rewards(previous: jax.Array, tokens: jax.Array, step: int, vocab: int):
  """The fraction of each sequence's tokens that follow the rule."""
  return jnp.mean(tokens == (previous + step) % vocab, axis=-1)


def advantages(reward: jax.Array, group: int) -> jax.Array:
  """Rewards normalised within each group of completions of one prompt."""
  grouped = reward.reshape(-1, group)
  mean = grouped.mean(axis=1, keepdims=True)
  std = grouped.std(axis=1, keepdims=True)
  return ((grouped - mean) / (std + 1e-6)).reshape(-1)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of ``x`` over the tokens ``mask`` keeps (excluded ones hold 0)."""
  return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


@nnx.jit
def old_log_probs(
  policy: Policy, previous: jax.Array, tokens: jax.Array, mask: jax.Array
):
  return policy.head.log_probs(policy.hidden(previous), tokens, where=mask)


@nnx.jit(static_argnames=("clip", "entropy_bonus", "loss_type"))
def train_step(
  policy: Policy,
  optimizer: nnx.Optimizer,
  previous: jax.Array,
  tokens: jax.Array,
  mask: jax.Array,
  old: jax.Array,
  advantage: jax.Array,
  clip: float,
  entropy_bonus: float,
  loss_type: str,
):
  """One step on the clipped surrogate (PPO / GRPO) with an entropy bonus."""

  def loss(policy):
    log_probs, entropy = policy.head.log_probs(
      policy.hidden(previous), tokens, where=mask, return_entropy=True
    )
    surrogate, _ = mst_jax.losses.policy_gradient_loss(
      log_probs, old, advantage, mask, loss_type=loss_type, epsilon_low=clip
    )
    mean_entropy = masked_mean(entropy, mask)
    return surrogate - entropy_bonus * mean_entropy, mean_entropy

  (_, mean_entropy), grads = nnx.value_and_grad(loss, has_aux=True)(policy)
  optimizer.update(policy, grads)
  return mean_entropy


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--iterations", type=int, default=150, help="sampling rounds")
  parser.add_argument("--prompts", type=int, default=32, help="prompts per round")
  parser.add_argument("--group", type=int, default=8, help="completions per prompt")
  parser.add_argument("--length", type=int, default=8, help="tokens per completion")
  parser.add_argument("--vocab", type=int, default=64, help="vocabulary size")
  parser.add_argument(
    "--step", type=int, default=3, help="the rule: next = prev + step"
  )
  parser.add_argument("--dim", type=int, default=64, help="hidden size")
  parser.add_argument("--epochs", type=int, default=2, help="optimizer steps per round")
  parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
  parser.add_argument("--clip", type=float, default=0.2, help="ratio clip epsilon")
  parser.add_argument(
    "--loss-type",
    default="dapo",
    choices=mst_jax.losses.POLICY_GRADIENT_LOSS_TYPES,
    help="how the tokens' losses are averaged (policy_gradient_loss)",
  )
  parser.add_argument(
    "--entropy-bonus", type=float, default=1e-3, help="weight of the mean entropy"
  )
  parser.add_argument("--seed", type=int, default=0, help="random seed")
  args = parser.parse_args(argv)

  policy = Policy(args.vocab, args.dim, nnx.Rngs(args.seed))
  optimizer = nnx.Optimizer(policy, optax.adam(args.lr), wrt=nnx.Param)
  key = jax.random.key(args.seed + 1)
  start = time.perf_counter()
  first_reward = None
  for iteration in range(args.iterations):
    key, prompt_key, sample_key = jax.random.split(key, 3)
    prompts = jax.random.randint(prompt_key, (args.prompts,), 0, args.vocab)
    first = jnp.repeat(prompts, args.group)  # each prompt, group times
    previous, tokens = sample(policy, sample_key, first, args.length)
    mask = jnp.ones(tokens.shape, bool)  # every token is the completion's
    reward = rewards(previous, tokens, args.step, args.vocab)
    advantage = advantages(reward, args.group)
    old = old_log_probs(policy, previous, tokens, mask)
    for _ in range(args.epochs):
      entropy = train_step(
        policy,
        optimizer,
        previous,
        tokens,
        mask,
        old,
        advantage,
        args.clip,
        args.entropy_bonus,
        args.loss_type,
      )
    mean_reward = float(reward.mean())
    first_reward = mean_reward if first_reward is None else first_reward
    if iteration % 10 == 0 or iteration == args.iterations - 1:
      print(
        f"round {iteration:4d}  reward {mean_reward:.3f}  entropy"
        f" {float(entropy):.2f} nats  ({time.perf_counter() - start:.0f} s)"
      )
  chance = 1 / args.vocab
  rose = mean_reward > 5 * max(first_reward, chance)
  print(
    f"verdict: the reward {'rose' if rose else 'DID NOT rise'}, from"
    f" {first_reward:.3f} to {mean_reward:.3f} (chance {chance:.3f})"
  )
  if not rose:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
