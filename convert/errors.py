"""The one error the Hugging Face converters raise for a bad input (a checkpoint, config or target).

It is a ValueError, so callers that already catch bad configuration catch it too; its message is
one line that names the offending value and what would have been accepted.
"""


class ConvertError(ValueError):
  """A checkpoint, config or export target the converters cannot use."""
