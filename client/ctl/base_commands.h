// trainstreamctl base load|list|drop (docs/base-cache.md).
#pragma once

#include <string>

#include "trainstream/client.h"

namespace trainstream::ctl {

// Runs `what` ("load", "list" or "drop") and prints the result to stdout.
// Progress of a load goes to stderr when it is a terminal.
Status RunBaseCommand(Client& client, const std::string& what, const BaseLoadOptions& load,
                      const std::string& drop_key, bool json);

}  // namespace trainstream::ctl
