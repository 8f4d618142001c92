"""The head node: running jobs, the control interval, the budget (``cdgpcd``)."""
