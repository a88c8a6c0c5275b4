"""Memory accounting: what the compiler says a step needs, and what the analytic model predicts."""
