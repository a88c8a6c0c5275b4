"""`python -S tests/warm_client.py SOCKET ARGS...`: runs `python ARGS...` as a child of the warm
server at SOCKET (tests/warm_python.py), or, where the server refuses or is gone, as a new
interpreter in this process's place. Signals that can be caught go on to the child; this process
exits as the child did (with its code, or killed by its signal). Standard library only, no site:
it starts in a few milliseconds."""
import json
import os
import signal
import socket
import sys

HEADER = 8   # as tests/warm_python.py's
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def _python(args: list[str]) -> None:
  os.execv(sys.executable, [sys.executable] + args)


def _receive(conn: socket.socket) -> dict | None:
  data = b''
  while len(data) < HEADER or len(data) < HEADER + int.from_bytes(data[:HEADER], 'big'):
    chunk = conn.recv(1 << 16)
    if not chunk:
      return None
    data += chunk
  return json.loads(data[HEADER:])


def main(path: str, args: list[str]) -> None:
  if not args or (args[0].startswith('-') and (args[0] != '-m' or len(args) < 2)):
    _python(args)   # python's own options, -c, or nothing: only a new interpreter does those
  if args[0] != '-m' and not os.path.isfile(args[0]):
    _python(args)   # python's own message and exit code for a script that is not there
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    conn.connect(path)
  except OSError:
    _python(args)
  ignored = [n for n in PASSED_ON if signal.getsignal(n) == signal.SIG_IGN]
  request = dict(args=args, cwd=os.getcwd(), env=dict(os.environ), ignored=ignored)
  data = json.dumps(request).encode()
  data = len(data).to_bytes(HEADER, 'big') + data
  try:
    sent = socket.send_fds(conn, [data], [0, 1, 2])
    conn.sendall(data[sent:])
    reply = _receive(conn)
  except OSError:   # a server that stopped
    reply = None
  if reply is None or 'refused' in reply:
    if os.environ.get('WARM_PYTHON_SAYS'):   # why it runs in a new interpreter, for a test's author
      print(f'warm python: {reply}', file=sys.stderr)
    conn.close()
    _python(args)
  pid = reply['pid']

  def pass_on(number, _):
    try:
      os.kill(pid, number)
    except ProcessLookupError:   # it has ended: its status is on the way
      pass
  for number in PASSED_ON:   # ignored here or not: the command, which may set its own, decides
    signal.signal(number, pass_on)
  reply = _receive(conn)
  if reply is None:   # the server died with the child
    os._exit(1)
  status = reply['status']
  if os.WIFSIGNALED(status):
    number = os.WTERMSIG(status)
    if number not in (signal.SIGKILL, signal.SIGSTOP):   # those two keep their default
      signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
  os._exit(os.waitstatus_to_exitcode(status))


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2:])
