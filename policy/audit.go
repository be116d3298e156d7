package policy

import (
	"context"
	"log/slog"
)

// Audit log keys: constant, so log queries and alerts can rely on them.
const (
	AuditMessage = "secret access decision"

	LogKeyDecision           = "decision" // allow, deny, would-deny
	LogKeyMode               = "mode"
	LogKeyRule               = "rule"
	LogKeyDriver             = "driver"
	LogKeyOperation          = "operation"
	LogKeySecretNamespace    = "secret_namespace"
	LogKeySecretName         = "secret_name"
	LogKeySource             = "source"
	LogKeySourceKey          = "source_key"
	LogKeyRequesterKind      = "requester_kind"
	LogKeyRequesterNamespace = "requester_namespace"
	LogKeyRequesterName      = "requester_name"
	LogKeyStorageClass       = "storage_class"
	LogKeyNode               = "node"
	LogKeyReason             = "reason"
)

// Audit writes one structured line for a decision: at Info for an allow, at
// Warn for a deny or a would-be deny. It names the decision, the rule, the
// secret reference, the driver, the operation and the requester; it never
// writes labels, template text or anything else from the request (and this
// package never holds secret content). A nil logger writes nothing.
func Audit(logger *slog.Logger, req Request, d Decision) {
	if logger == nil {
		return
	}
	level := slog.LevelInfo
	if !d.Allowed || d.WouldDeny {
		level = slog.LevelWarn
	}
	ctx := context.Background()
	if !logger.Enabled(ctx, level) {
		return
	}
	logger.LogAttrs(ctx, level, AuditMessage,
		slog.String(LogKeyDecision, d.Result()),
		slog.String(LogKeyMode, string(d.Mode)),
		slog.String(LogKeyRule, d.Rule),
		slog.String(LogKeyDriver, req.Driver),
		slog.String(LogKeyOperation, string(req.Operation)),
		slog.String(LogKeySecretNamespace, req.Secret.Namespace),
		slog.String(LogKeySecretName, req.Secret.Name),
		slog.String(LogKeySource, string(req.Source.Kind)),
		slog.String(LogKeySourceKey, req.Source.Key),
		slog.String(LogKeyRequesterKind, req.Requester.Kind),
		slog.String(LogKeyRequesterNamespace, req.Requester.Namespace),
		slog.String(LogKeyRequesterName, req.Requester.Name),
		slog.String(LogKeyStorageClass, req.Requester.StorageClass),
		slog.String(LogKeyNode, req.Requester.Node),
		slog.String(LogKeyReason, d.Reason),
	)
}
