"""Know before you rent: enumerate training recipes for a target set of GPUs, keep those the
analytic memory model says fit, rank them by estimated step time, verify by compiling."""
