"""What the machine folio runs on offers: CPU features today."""
