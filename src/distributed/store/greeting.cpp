#include "distributed/store/greeting.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "distributed/store/sha256.h"

namespace dparallel::dist::greeting {

using wire::Command;
using wire::ReplyStatus;

std::string hmac_sha256(const std::string& key, const std::string& message) { return hmac_sha256_bytes(key, message); }

std::string server_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce) {
  return hmac_sha256(token, "dparallel store server\n" + client_nonce + server_nonce);
}

std::string client_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce) {
  return hmac_sha256(token, "dparallel store client\n" + server_nonce + client_nonce);
}

bool equal_in_constant_time(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  // volatile keeps the compiler from stopping at the first difference.
  volatile uint8_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ = differ | static_cast<uint8_t>(a[i] ^ b[i]);
  return differ == 0;
}

std::string random_nonce() {
  std::string nonce(wire::kNonceBytes, '\0');
  size_t filled = 0;
  while (filled < nonce.size()) {
    ssize_t got = getrandom(nonce.data() + filled, nonce.size() - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(StatusCode::kInternal, "the system's random source (getrandom) failed: ", std::strerror(errno));
    }
    filled += static_cast<size_t>(got);
  }
  return nonce;
}

void greet_server(const Exchange& exchange, const std::string& token, const std::string& where) {
  std::string client_nonce = random_nonce();
  wire::Request hello;
  hello.command = Command::kHello;
  hello.keys.push_back(client_nonce);
  wire::Reply r = exchange(wire::encode_request(hello));
  std::string answer(r.payload.begin(), r.payload.end());
  if (r.status != ReplyStatus::kOk || answer.size() != wire::kNonceBytes + wire::kProofBytes) {
    fail(StatusCode::kRemote, "the server at ", where,
         " did not answer the greeting as a dparallel store does (status ", static_cast<int>(r.status), ", ",
         answer.size(), " bytes)");
  }
  std::string server_nonce = answer.substr(0, wire::kNonceBytes);
  if (!equal_in_constant_time(answer.substr(wire::kNonceBytes), server_proof(token, client_nonce, server_nonce))) {
    fail(StatusCode::kRemote, "the store at ", where,
         " does not know this client's job token (DP_STORE_TOKEN): the tokens differ, or it is another job's "
         "store; not trusted");
  }
  wire::Request proof;
  proof.command = Command::kProof;
  proof.keys.push_back(client_proof(token, client_nonce, server_nonce));
  r = exchange(wire::encode_request(proof));
  if (r.status != ReplyStatus::kOk) {
    fail(StatusCode::kRemote, "the store at ", where,
         " refused this client: its job token (DP_STORE_TOKEN) does not match the server's");
  }
}

ServerGreeting::Step ServerGreeting::on_request(const wire::Request& request, wire::Reply* reply, std::string* why) {
  reply->payload.clear();
  if (server_nonce_.empty()) {
    if (request.command != Command::kHello || request.keys[0].size() != wire::kNonceBytes) {
      *why = "refused: the first message was not a greeting";
      return Step::kDrop;
    }
    client_nonce_ = request.keys[0];
    server_nonce_ = random_nonce();
    std::string answer = server_nonce_ + server_proof(token_, client_nonce_, server_nonce_);
    reply->status = ReplyStatus::kOk;
    reply->payload.assign(answer.begin(), answer.end());
    return Step::kAnswer;
  }
  if (request.command != Command::kProof) {
    *why = "refused: the greeting was not followed by a proof of the job token";
    return Step::kDrop;
  }
  if (!equal_in_constant_time(request.keys[0], client_proof(token_, client_nonce_, server_nonce_))) {
    *why = "refused: job token mismatch (DP_STORE_TOKEN)";
    reply->status = ReplyStatus::kRefused;
    return Step::kRefused;
  }
  reply->status = ReplyStatus::kOk;
  return Step::kGreeted;
}

}  // namespace dparallel::dist::greeting
