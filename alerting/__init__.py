"""stepscope alerting: P99 and SLO burn-rate rules on the stored requests, Alertmanager-shaped webhooks that
carry the breakdown of the breached metric and the diagnosis's findings (docs/alerts.md).

    from alerting.rules import load_rules          # RuleSet(notify, rules); RuleError names rule and field
    from alerting.runner import AlertRunner        # AlertRunner(ruleset, source).start() / .evaluate(now)
    from alerting.evaluator import step, judge     # the pure state machine
    from alerting.notify import alertmanager_payload, WebhookSender

Inside the collector: `stepscope collector --alert-rules rules.toml` (alerting.embedded). Beside one:
`stepscope alerts run --rules rules.toml --api URL` (alerting.cli).
"""
