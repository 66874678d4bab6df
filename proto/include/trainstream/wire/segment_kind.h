// What a shared-memory segment holds (docs/design.md, "Memory ownership and
// segment kinds"): the one SegmentKind of the project. The daemon writes it into
// every SegmentHeader (segment_header.h) and hands it to clients in each
// trainstream.v1.Region; the C++ client's RegionInfo carries it
// (trainstream::SegmentKind is this enum).
//
// Note [Segment kind numbers are the wire's]. The numbers are
// trainstream.v1.SegmentKind's (SEGMENT_KIND_UNSPECIFIED = 0 is why kBase is 1):
// they are written into segment files a later daemon adopts and carried over
// gRPC, so they never change. Where a number crosses between the generated enum
// and this one it is a cast, and a static_assert beside the cast pins the two
// (daemon/memory/shm_segment.cc, client/src/client.cc).
#pragma once

#include <cstdint>

namespace trainstream::wire {

enum class SegmentKind : uint32_t {
  kBase = 1,     // a frozen checkpoint; clients map it read-only
  kSession = 2,  // a session's control region, staging slots and regions; its client maps it
  kState = 3,    // master weights, moments and recovery records; the daemon's alone
};

}  // namespace trainstream::wire
