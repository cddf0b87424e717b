"""The fixed utterances `orpheus-tts bench engine` speaks: voice-agent turns from a few words to two sentences' worth.

Shipped with the package so that every run, on any machine, offers the same workload. Lengths
(about 15 to 420 characters) are spread so that the short turns that dominate conversations and
the long ones that split into several generations are both present; a few carry emotion tags.
"""

from __future__ import annotations

UTTERANCES: tuple[str, ...] = (
    "Sure, one moment.",
    "Yes, that's right.",
    "Could you repeat that, please?",
    "Thanks for calling. How can I help you today?",
    "Got it. Your order number is A 7 4 9 2.",
    "Oh, I'm sorry to hear that. <sigh> Let me see what I can do.",
    "Your appointment is confirmed for Tuesday, March fourth, at ten fifteen in the morning.",
    "That's hilarious! <laugh> I can't believe he actually said that to the manager.",
    "I've found two flights that match: one leaves at seven forty, the other just after noon.",
    "Before we continue, I need to verify your identity. Can you tell me your date of birth?",
    "The forecast for tomorrow calls for light rain in the morning, clearing up by the afternoon, "
    "with a high of sixty eight degrees.",
    "Okay, I've updated your shipping address. You'll receive a confirmation email in the next few minutes.",
    "Hmm, let me think about that for a second. <chuckle> Honestly, both options sound pretty good to me.",
    "To reset your password, open the settings page, choose security, and then tap the button that says "
    "forgot password. We'll send a code to your phone.",
    "Welcome back! Last time we spoke, you were interested in the premium plan. Would you like to hear "
    "about the new discount we're offering this month?",
    "I understand this has been frustrating, and I really appreciate your patience. I've escalated the "
    "case to our senior team, and someone will call you back within twenty four hours.",
    "Here's a quick summary of your account: your current balance is one hundred and twelve dollars and "
    "fifty cents, your next payment is due on the fifteenth, and autopay is turned off.",
    "Great question. The museum opens at nine, but the best time to visit is right after lunch, when "
    "the morning tour groups have left and the galleries are much quieter.",
    "Let me walk you through the steps. First, unplug the router and wait thirty seconds. Then plug it "
    "back in and wait for the light on the front to turn solid green. If it keeps blinking orange, call "
    "us back and we'll send a technician.",
    "Thank you for your patience while I looked into this. It turns out the charge on your statement was "
    "a temporary authorization from the hotel, not a real payment, so it should disappear within three "
    "to five business days. If it's still there after a week, just reply to this message and I'll "
    "file a dispute for you right away.",
    "Absolutely, I can help with that.",
    "No problem at all. <laugh> Happens to everyone.",
    "Your package left our warehouse this morning and is expected to arrive on Thursday before six.",
    "I'm afraid that table is fully booked tonight, but I can offer you a spot at eight thirty, or "
    "the same table tomorrow at seven.",
)
