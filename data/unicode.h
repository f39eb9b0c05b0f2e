// unicode.h: the Unicode facts the tokenizers need: UTF-8 decoding that never rejects
// input, the character classes used by the pre-tokenizer rules, and NFC normalization.
// Conventions: text is a byte string that may hold invalid UTF-8. Each byte that does
// not start a well-formed sequence (stray continuation bytes, overlong forms,
// surrogates, values above U+10FFFF, truncated sequences) decodes as one "invalid
// byte" character of class Other, so tokenization is defined for every byte string.
// Classes follow Unicode (via ICU): Letter = L*, Number = N*, Space = White_Space
// (what Hugging Face tokenizers' regex engine means by \s).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace mhar::data {

enum class CharClass : uint8_t { Letter, Number, Space, Other };

struct DecodedChar {
  char32_t code;    // the code point; kInvalidByte for an invalid byte
  uint8_t length;   // bytes consumed, 1..4
};
inline constexpr char32_t kInvalidByte = 0xFFFFFFFF;

// Decodes the character starting at s[i] (i < s.size()).
inline DecodedChar decode_utf8(std::string_view s, size_t i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) return {b0, 1};
  auto cont = [&](size_t k, uint8_t lo = 0x80, uint8_t hi = 0xBF) {
    if (i + k >= s.size()) return false;
    const auto b = static_cast<uint8_t>(s[i + k]);
    return b >= lo && b <= hi;
  };
  auto byte = [&](size_t k) { return static_cast<char32_t>(static_cast<uint8_t>(s[i + k]) & 0x3F); };
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (cont(1)) return {((b0 & 0x1Fu) << 6) | byte(1), 2};
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    const uint8_t lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
    if (cont(1, lo, hi) && cont(2)) return {((b0 & 0x0Fu) << 12) | (byte(1) << 6) | byte(2), 3};
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    const uint8_t lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
    if (cont(1, lo, hi) && cont(2) && cont(3))
      return {((b0 & 0x07u) << 18) | (byte(1) << 12) | (byte(2) << 6) | byte(3), 4};
  }
  return {kInvalidByte, 1};
}

// The class of a code point (kInvalidByte is Other).
CharClass char_class(char32_t c);

// True when the text may change under NFC (contains a code point >= U+0300); text
// below that is always NFC and is passed through untouched without calling ICU.
bool may_need_nfc(std::string_view text);

// NFC of the text. Invalid bytes are kept as they are and act as boundaries: each
// well-formed run between them is normalized on its own.
std::string nfc(std::string_view text);

}  // namespace mhar::data
