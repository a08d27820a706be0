// The TCP store's greeting: each side proves it knows the job token without
// sending it. The client's kHello carries its nonce; the server answers kOk
// with its own nonce and proof; the client checks that and sends kProof
// with its proof; the server answers kOk, or kRefused and closes. Proofs are
// HMAC-SHA256 under the token over both nonces.
#pragma once

#include <functional>
#include <string>

#include "distributed/store/tcp_protocol.h"

namespace dparallel::dist::greeting {

// HMAC-SHA256 of `message` under `key`.
std::string hmac_sha256(const std::string& key, const std::string& message);
// The server's proof is over (client nonce, server nonce), the client's the other way round.
std::string server_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce);
std::string client_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce);
// Compares in time independent of where the strings differ.
bool equal_in_constant_time(const std::string& a, const std::string& b);
// kNonceBytes from the system's random source.
std::string random_nonce();

// Sends a request frame and returns its reply (the client's connection).
using Exchange = std::function<wire::Reply(const std::vector<uint8_t>& frame)>;
// Greets the server at `where` (host:port, for messages); kRemote when it
// cannot prove the token or refuses ours.
void greet_server(const Exchange& exchange, const std::string& token, const std::string& where);

// The server's side of one connection's greeting.
class ServerGreeting {
 public:
  enum class Step {
    kAnswer,   // send `reply`; the greeting goes on
    kGreeted,  // send `reply`; the client may now make requests
    kRefused,  // send `reply`, then close; `why` says why
    kDrop,     // close at once; `why` says why
  };
  explicit ServerGreeting(const std::string& token) : token_(token) {}
  Step on_request(const wire::Request& request, wire::Reply* reply, std::string* why);

 private:
  std::string token_;
  std::string client_nonce_, server_nonce_;
};

}  // namespace dparallel::dist::greeting
