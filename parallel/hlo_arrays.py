"""The arrays named in HLO text and their sizes: the one reading of an HLO type such as
`bf16[8,256]{1,0:S(5)}` that every reader of compiled programs shares (collectives, the memory at
a program's edge, the profile's bytes per instruction).

A dtype's width is the number in its name (`s4`, `bf16`, `f8e4m3fn`, `c64`: 4, 16, 8, 64 bits);
`pred` takes a byte and a `token` none. Arrays of sub-byte types are packed, so an array's bytes
are its bits rounded up to whole bytes.
"""
import math
import re

# dtype, dimensions, and the layout (minor-to-major order, tiles, memory space) where printed.
ARRAY = re.compile(r'\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](?:\{([^}]*)\})?')
_WIDTH = re.compile(r'[a-z]+(\d+)')
_NO_NUMBER_BITS = {'pred': 8, 'token': 0}


def dtype_bits(dtype: str) -> int:
  """Bits of one value of an HLO dtype; 0 for a name that carries no data (token, opaque)."""
  width = _WIDTH.match(dtype)
  return int(width.group(1)) if width else _NO_NUMBER_BITS.get(dtype, 0)


def array_bytes(dtype: str, dims: str) -> int:
  """Bytes of an array of `dtype` with the comma-separated dimensions `dims` ('' for a scalar)."""
  return math.ceil(dtype_bits(dtype) * math.prod(int(d) for d in dims.split(',') if d) / 8)


def arrays(type_text: str) -> list[tuple[int, str]]:
  """(bytes, layout text) of each array in an HLO type, a tuple's in order."""
  return [(array_bytes(dtype, dims), layout or '')
          for dtype, dims, layout in ARRAY.findall(type_text)]


def type_bytes(type_text: str) -> int:
  """Bytes of an HLO type, all the arrays of a tuple together."""
  return sum(size for size, _ in arrays(type_text))
