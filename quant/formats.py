"""The number formats the project stores and computes in, as one table read off JAX itself.

Floats and ints are described by `jnp.finfo` / `jnp.iinfo` (so the table is whatever the installed
ml_dtypes says); NF4 is a 16-entry code book (quant/nf4.py) whose values are relative to a block's
absolute maximum. A hand-written table of the published values checks the computed one.
`python -m quant.formats` prints it as markdown for WORKSPACE.md.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np

from quant.nf4 import nf4_code

# (name, dtype); None marks the code book. Ints of 4 bits are stored two per byte.
FORMATS = (('fp32', jnp.float32), ('bf16', jnp.bfloat16), ('fp16', jnp.float16),
           ('fp8_e4m3', jnp.float8_e4m3fn), ('fp8_e5m2', jnp.float8_e5m2),
           ('int8', jnp.int8), ('int4', jnp.int4), ('nf4', None))

# Published values: IEEE 754 (fp32, fp16), bfloat16, OCP FP8 (E4M3 without infinities, E5M2),
# two's complement ints, and NF4 from QLoRA. (bits, exponent bits, fraction bits, largest finite,
# smallest finite, smallest positive normal / step, bytes/value).
EXPECTED = {
    'fp32': (32, 8, 23, 3.4028234663852886e38, -3.4028234663852886e38, 2.0 ** -126, 4),
    'bf16': (16, 8, 7, 3.3895313892515355e38, -3.3895313892515355e38, 2.0 ** -126, 2),
    'fp16': (16, 5, 10, 65504.0, -65504.0, 2.0 ** -14, 2),
    'fp8_e4m3': (8, 4, 3, 448.0, -448.0, 2.0 ** -6, 1),
    'fp8_e5m2': (8, 5, 2, 57344.0, -57344.0, 2.0 ** -14, 1),
    'int8': (8, 0, 0, 127, -128, 1, 1),
    'int4': (4, 0, 0, 7, -8, 1, 0.5),
    'nf4': (4, 0, 0, 1.0, -1.0, 0.07958029955625534, 0.5),
}


@dataclasses.dataclass(frozen=True)
class FormatRow:
  name: str
  dtype: str
  bits: int
  exponent_bits: int
  fraction_bits: int
  largest: float          # largest finite value
  smallest: float         # most negative finite value
  tiny: float             # smallest positive normal (floats), step (ints), smallest positive code (nf4)
  bytes_per_value: float  # as stored; 4-bit formats packed two per byte

  def values(self) -> tuple:
    return (self.bits, self.exponent_bits, self.fraction_bits, self.largest, self.smallest,
            self.tiny, self.bytes_per_value)


def format_row(name: str, dtype) -> FormatRow:
  if dtype is None:
    code = nf4_code()
    return FormatRow(name, 'uint8 (2 codes/byte)', 4, 0, 0, float(code[-1]), float(code[0]),
                     float(code[code > 0].min()), 0.5)
  if jnp.issubdtype(dtype, jnp.floating):
    info = jnp.finfo(dtype)
    return FormatRow(name, jnp.dtype(dtype).name, info.bits, info.nexp, info.nmant,
                     float(info.max), float(info.min), float(info.tiny), info.bits / 8)
  info = jnp.iinfo(dtype)
  return FormatRow(name, jnp.dtype(dtype).name, info.bits, 0, 0, int(info.max), int(info.min), 1,
                   info.bits / 8)


def format_rows() -> list[FormatRow]:
  return [format_row(name, dtype) for name, dtype in FORMATS]


def check_against_expected(rows: list[FormatRow] | None = None, rtol: float = 1e-6) -> list[str]:
  """One line per field where the computed table differs from EXPECTED; empty when they agree."""
  fields = [f.name for f in dataclasses.fields(FormatRow)][2:]
  problems = []
  for row in rows or format_rows():
    if row.name not in EXPECTED:
      problems.append(f'{row.name}: no expected row')
      continue
    for field, got, want in zip(fields, row.values(), EXPECTED[row.name]):
      if not np.isclose(got, want, rtol=rtol, atol=0):
        problems.append(f'{row.name}.{field}: computed {got!r}, expected {want!r}')
  return problems


def markdown_table(rows: list[FormatRow] | None = None) -> str:
  header = ('| format | stored as | bits | exponent bits | fraction bits | largest finite | '
            'most negative | smallest positive normal / step | bytes/value |')
  lines = [header, '|' + '---|' * header.count(' | ') + '---|']
  for r in rows or format_rows():
    lines.append(f'| {r.name} | {r.dtype} | {r.bits} | {r.exponent_bits} | {r.fraction_bits} | '
                 f'{r.largest:.6g} | {r.smallest:.6g} | {r.tiny:.6g} | {r.bytes_per_value:g} |')
  lines.append('')
  lines.append('Ints: step 1, no exponent or fraction. nf4: a 16-entry code book (no exponent or '
               'fraction), values relative to each block\'s absmax; one fp32 absmax per 64 values '
               'adds 0.0625 bytes/value, 8-bit double-quantized absmaxes add ~0.016 (0.5 + 0.016 '
               '= 0.516 bytes/value). int4/nf4 bytes/value: packed two per byte.')
  return '\n'.join(lines)


if __name__ == '__main__':
  print(markdown_table())
  problems = check_against_expected()
  if problems:
    raise SystemExit('formats differ from the published values:\n' + '\n'.join(problems))
