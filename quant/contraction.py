"""The one contraction every dense product computes: x [..., *in] @ kernel [*in, *out]."""
import jax


def dense_dims(x: jax.Array, n_in: int) -> jax.lax.DotDimensionNumbers:
  """`dot_general` dimension numbers contracting the last `n_in` dims of x with the first of the
  kernel (several input dims, e.g. [heads, head_dim] -> [embed], need no reshape)."""
  return ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
