"""Number formats and precision: the dense layer every projection goes through, precision policies, loss scaling."""
