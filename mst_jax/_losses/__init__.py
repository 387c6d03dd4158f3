"""The public functions' implementations: ``linear_cross_entropy``,
``linear_log_probs`` and ``linear_distillation_loss``.
"""
