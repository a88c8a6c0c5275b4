"""SwiGLU's gated product, silu(gate) * up, with a backward that keeps only its two inputs.

Differentiated by autodiff, the product keeps what each of its operations needs: the gate, the up
projection, the sigmoid and silu(gate), and XLA:GPU saves more forms of them besides (the 1b step
with remat none compiled for an H200: six [tokens, mlp_dim] stacks per layer; by our reading of
autograd, not measured, PyTorch's eager loop keeps four). Here the backward recomputes the sigmoid from the gate, in
fp32, in the one elementwise pass that forms both gradients. The forward is the plain product's,
bit for bit.
"""
import jax
import jax.numpy as jnp


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def _forward(gate, up):
  return swiglu(gate, up), (gate, up)


def _backward(residuals, g):
  gate, up = residuals
  gate32, up32, g32 = (a.astype(jnp.float32) for a in (gate, up, g))
  sigmoid = jax.nn.sigmoid(gate32)
  d_up = g32 * gate32 * sigmoid
  # d silu(x) / dx = sigmoid(x) * (1 + x * (1 - sigmoid(x)))
  d_gate = g32 * up32 * sigmoid * (1 + gate32 * (1 - sigmoid))
  return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu.defvjp(_forward, _backward)
