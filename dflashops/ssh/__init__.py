"""The SSH stack, one layer per module; each imports only those listed before it.

- paramiko_lib: paramiko, imported without `invoke`, its logger quiet
- config: what ~/.ssh/config makes of an inventory host (`Resolved`)
- known_hosts: the known_hosts files we trust for a host, read as OpenSSH reads them
- keys: logging in with public keys as OpenSSH does
- keepalive: how soon a silent server counts as gone; the keepalive that finds it
- openssh: the OpenSSH client for bulk copies and terminals, under a private config
- connection: one lazily opened connection per host (`Connection`)
- channel: a command on a session channel of a connection (`ChannelProcess`)
- session: what one command holds: the inventory, connections, machines, a thread pool
"""
