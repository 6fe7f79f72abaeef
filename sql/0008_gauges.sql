-- 0008: the metrics gauges count every status on a timer. Active statuses have partial indexes
-- already; cancelled rows are few, and this index lets them be counted without reading the
-- (many) succeeded rows.
CREATE INDEX operations_cancelled ON outbox.operations (status_changed_at) WHERE status = 'cancelled';
