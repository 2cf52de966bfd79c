"""The control channel of a mount: the control directory (control_dir), its sockets (listener), the
prefetch and shared-block services on them (announce, share)."""
