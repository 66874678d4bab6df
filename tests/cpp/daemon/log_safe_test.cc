// LogSafe / PrintableUtf8 (Note [Client strings in the log]) and PeerTable's
// per-uid connection count (Note [Counting connections gRPC owns]).
#include "logging/log_safe.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "catch_compat.h"
#include "transport/peer_credentials.h"

using namespace trainstream::daemon;

TEST_CASE("LogSafe escapes what could forge a log line", "[log_safe]") {
  CHECK(LogSafe("job-1 rank=0 ünïcode ✓") == "job-1 rank=0 ünïcode ✓");
  CHECK(LogSafe("a\nb") == "a\\x0ab");
  CHECK(LogSafe("\r\t\x1b[31mred") == "\\x0d\\x09\\x1b[31mred");
  CHECK(LogSafe(std::string("nul\0x", 5)) == "nul\\x00x");
  CHECK(LogSafe("del\x7f") == "del\\x7f");
  CHECK(LogSafe("back\\x0a") == "back\\x5cx0a");  // a typed escape cannot pass for one
  CHECK(LogSafe("\xc2\x9b"
                "2J") == "\\xc2\\x9b2J");  // U+009B, CSI in some terminals
  CHECK(LogSafe("\xff\xfe") == "\\xff\\xfe");
  CHECK(LogSafe("\xc3") == "\\xc3");                    // truncated sequence
  CHECK(LogSafe("\xc0\xaf") == "\\xc0\\xaf");           // overlong '/'
  CHECK(LogSafe("\xed\xa0\x80") == "\\xed\\xa0\\x80");  // surrogate
  CHECK(LogSafe(std::string(300, 'a'), 256) == std::string(256, 'a') + "...(+44 bytes)");
}

TEST_CASE("PrintableUtf8 accepts text and refuses controls and bad UTF-8", "[log_safe]") {
  CHECK(PrintableUtf8(""));
  CHECK(PrintableUtf8("torchrun-abc123:29500/0"));
  CHECK(PrintableUtf8("模型 😀"));
  CHECK_FALSE(PrintableUtf8("a\nb"));
  CHECK_FALSE(PrintableUtf8("\x1b[2J"));
  CHECK_FALSE(PrintableUtf8("\xc2\x85"));  // NEL
  CHECK_FALSE(PrintableUtf8("\xff"));
}

TEST_CASE("PeerTable counts a uid's connections until gRPC closes them", "[peer_table]") {
  PeerTable table;
  PeerCredentials alice;
  alice.uid = 1001;
  PeerCredentials bob;
  bob.uid = 1002;
  int a[2], b[2], c[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, a) == 0);
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, b) == 0);
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, c) == 0);
  uint32_t live = 0;
  REQUIRE(table.Admit(a[0], alice, 2, &live));
  REQUIRE(table.Admit(b[0], alice, 2, &live));
  CHECK(live == 2);
  CHECK_FALSE(table.Admit(c[0], alice, 2, &live));  // over the cap
  CHECK(live == 2);
  CHECK(table.Admit(c[0], bob, 2, &live));  // the cap is per uid
  CHECK(table.LiveConnections(alice.uid) == 2);

  // gRPC closes a connection; its number is reused by a file: neither counts.
  close(a[0]);
  CHECK(table.LiveConnections(alice.uid) == 1);
  close(b[0]);
  const int file = open("/dev/null", O_RDONLY);
  REQUIRE(file >= 0);
  CHECK(table.LiveConnections(alice.uid) == 0);
  int d[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, d) == 0);
  CHECK(table.Admit(d[0], alice, 2, &live));
  CHECK(live == 1);

  // A reused number that is a new connection replaces the old entry.
  PeerCredentials found;
  CHECK(table.Lookup("fd:" + std::to_string(d[0]), &found));
  CHECK(found.uid == alice.uid);
  for (int fd : {a[1], b[1], c[0], c[1], d[0], d[1], file}) close(fd);
}
