"""What people read: status, report, dashboard, the experiment catalogue, progress lines."""
