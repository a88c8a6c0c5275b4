"""The number-format table: read off finfo/iinfo, agreeing with the published values, printable."""
import dataclasses

import jax.numpy as jnp

from quant import formats


def test_table_has_every_project_format_in_order():
  assert [r.name for r in formats.format_rows()] == [
      'fp32', 'bf16', 'fp16', 'fp8_e4m3', 'fp8_e5m2', 'int8', 'int4', 'nf4']


def test_computed_rows_agree_with_the_published_values():
  assert formats.check_against_expected() == []


def test_float_rows_are_read_from_finfo_and_int_rows_from_iinfo():
  rows = {r.name: r for r in formats.format_rows()}
  e4m3 = jnp.finfo(jnp.float8_e4m3fn)
  assert rows['fp8_e4m3'].values()[:3] == (e4m3.bits, e4m3.nexp, e4m3.nmant)
  assert rows['fp8_e4m3'].largest == float(e4m3.max) and rows['fp8_e4m3'].tiny == float(e4m3.tiny)
  assert (rows['int4'].largest, rows['int4'].smallest) == (jnp.iinfo(jnp.int4).max, jnp.iinfo(jnp.int4).min)
  # sign + exponent + fraction fill the word of every float format
  for name in ('fp32', 'bf16', 'fp16', 'fp8_e4m3', 'fp8_e5m2'):
    assert 1 + rows[name].exponent_bits + rows[name].fraction_bits == rows[name].bits


def test_check_reports_a_wrong_row():
  rows = formats.format_rows()
  rows[2] = dataclasses.replace(rows[2], largest=65520.0)   # fp16's overflow threshold, not max
  assert formats.check_against_expected(rows) == ['fp16.largest: computed 65520.0, expected 65504.0']


def test_markdown_table_has_units_and_a_row_per_format():
  table = formats.markdown_table()
  lines = table.splitlines()
  assert 'bytes/value' in lines[0] and lines[1].count('---') == lines[0].count('|') - 1
  assert sum(line.startswith('| ') for line in lines[2:]) == len(formats.FORMATS)
  assert '| nf4 | uint8 (2 codes/byte) | 4 |' in table
